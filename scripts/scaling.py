"""The quadratic bill, measured: the reference attention() against flash_attention() as T doubles.

    python scripts/scaling.py                      # 1 sequence, 4 heads of 64, causal, float32, T up to 8192
    python scripts/scaling.py --torch              # add torch SDPA on the CPU (same dtype, same threads)
    python scripts/scaling.py --no-causal          # the same without the mask
    python scripts/scaling.py --plot time.png      # and draw time and memory against T

Every time is the median of --repeats runs after two warm-ups; every peak is what tracemalloc saw in a
separate run, next to tinyattn_np.memory's estimate. With --torch, flash and torch take turns: --rounds
turns of --repeats runs each, each turn after an idle and two warm-ups, so that a machine whose speed
drifts during a row slows both alike. Figures are ratios within this one run: the machine is shared and
noisy, so compare columns, not runs. A row measured while the machine was busy
(its matmul rate moved by more than 20%, or the load exceeded the cores) is marked with *.

The other attention benchmarks are scripts of their own:
    python scripts/torch_naive.py         the article's CPU table: torch naive vs torch fused, ours beside
    python scripts/tiles.py --tokens T    flash's tile sizes and workers at one T, and the 16-core model
    python scripts/scaling_backward.py    flash_attention_backward as T doubles
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import attention, flash_attention, format_bytes, naive_attention_bytes
from tinyattn_np.measure import alternating_medians_ms, traced_peak
from tinyattn_np.memory import attention_flops, score_matrix_bytes
from tinyattn_np.peaks import flash_attention_bytes
from tinyattn_np.report import add_wide_argument, positive, table_width
from tinyattn_np.tune import default_tiles

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import benchmark
import interrupts
import limits
import machine
import outputs
import torch_import

# Flags of tables that other scripts print: each names the script in one line.
MOVED = {
    "--torch-naive": "python scripts/torch_naive.py",
    "--sweep-blocks": "python scripts/tiles.py --tokens {value}",
    "--backward": "python scripts/scaling_backward.py",
}


class Moved(argparse.Action):
    """A flag of a table another script prints: one line naming that script, and exit 2 (a usage error)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        command = MOVED[str(option_string)].format(value=values or "T")
        print(f"scaling.py: error: {option_string} is a script of its own: {command}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_shape_arguments(p)
    benchmark.add_flash_arguments(p)
    benchmark.add_budget_argument(p)
    add_wide_argument(p)
    p.add_argument("--torch", action="store_true", help="add a torch SDPA CPU column (needs torch)")
    p.add_argument(
        "--rounds",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="with --torch: turns of --repeats runs each, flash's and torch's alternating (default 3)",
    )
    p.add_argument(
        "--torch-3d",
        action="store_true",
        help="with --torch, also time torch on 3-D (H, T, E) inputs, which its CPU backend sends to the slow math path",
    )
    outputs.add_plot_arguments(p, "time and memory against T")
    for flag in MOVED:
        p.add_argument(flag, nargs="?", action=Moved, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_3d and not args.torch:
        p.error("--torch-3d needs --torch")
    benchmark.check_sizes(p, args, args.max_tokens)
    outputs.check_plot(p, args.plot, args.overwrite)
    return args


def run_flops(args: argparse.Namespace, sizes: list[int], causal: bool) -> float:
    """FLOPs of the whole run, for the refusal of a run too long (--repeats 1000000000 stops there): naive,
    flash, and flash without the mask, each --repeats times, after two warm-ups and before a traced run; with
    --torch, flash and torch each --rounds turns of --repeats runs after two warm-ups."""
    runs = args.repeats + 3
    turns = args.rounds * (args.repeats + 2) * 2 if args.torch else runs  # flash's runs, and torch's as many
    full = sum(attention_flops(T, heads=args.heads, head_dim=args.head_dim) for T in sizes)
    masked = sum(attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal) for T in sizes)
    return (runs + turns) * masked + runs * (full if causal else 0)


def torch_runner(threads: int) -> tuple[Any, str]:
    """(a function (q, k, v, causal) -> a call of torch SDPA on those arrays, torch's version)."""
    torch, F = torch_import.load_torch(threads)

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> Any:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))  # shares the memory, no copy
        return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return run, torch.__version__


def measure_row(T: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """Every figure of one row: naive (unless over the budget), flash with and without the mask, torch."""
    outputs.progress(f"T = {T}")
    q, k, v = benchmark.make_qkv(np.random.default_rng(args.seed + T), T, args)
    causal = run.causal
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=causal)
    blocks = benchmark.flash_knobs(args)  # block_q, block_k, workers, kv_heads_per_step
    row: dict[str, Any] = {
        "tokens": T,
        "tiles": "{} x {}".format(*flash_tiles(args, T)),
        "score_matrix_bytes": score_matrix_bytes(T, heads=args.heads, dtype=args.dtype),
        "naive_estimate_bytes": naive_attention_bytes(T, **dims),
        "flash_estimate_bytes": flash_attention_bytes(T, **dims, **blocks),
        "flops": attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal),
        "naive_ms": None,
        "naive_peak_bytes": None,
    }
    if row["naive_estimate_bytes"] <= run.budget:
        outputs.progress(f"  T={T}: naive")
        row["naive_ms"] = machine.settled_median_ms(lambda: attention(q, k, v, causal=causal), args.repeats)
        row["naive_peak_bytes"] = traced_peak(attention, q, k, v, causal=causal)[1]
    outputs.progress(f"  T={T}: flash" + (" and torch, in turns" if run.torch else ""))
    row.update(machine.beside_the_row(args.dtype, run.rate))  # "of matmul" compares like with like
    flash = lambda: flash_attention(q, k, v, causal=causal, **blocks)  # noqa: E731
    if run.torch is None:
        row["flash_ms"] = machine.settled_median_ms(flash, args.repeats)
    else:  # turns: a machine whose speed drifts during the row slows both alike
        row["flash_ms"], row["torch_ms"] = alternating_medians_ms(
            [flash, run.torch(q, k, v, causal)], args.repeats, args.rounds, idle=machine.SETTLE_SECONDS
        )
    row["flash_peak_bytes"] = traced_peak(flash_attention, q, k, v, causal=causal, **blocks)[1]
    if causal:  # the same flash run without the mask: how much the skipped tiles save
        row["flash_no_mask_ms"] = machine.settled_median_ms(lambda: flash_attention(q, k, v, **blocks), args.repeats)
    if args.torch_3d:  # torch on the same numbers without the batch axis: (H, T, E)
        outputs.progress(f"  T={T}: torch 3-D")
        row["torch_3d_ms"] = machine.settled_median_ms(run.torch(q[0], k[0], v[0], causal), args.repeats)
    return row


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, causal: bool) -> None:
    headers = ["tokens", "scores MiB", "naive ms", "tiles", "flash ms", "speedup", "naive peak MiB", "(est.)"]
    headers += ["flash peak MiB", "(est.)", "flash GFLOP/s", "of matmul"]
    if causal:
        headers += ["no-mask ms", "causal/no-mask"]
    if args.torch:
        headers += ["torch ms", "torch of matmul", "flash/torch"]
    if args.torch_3d:
        headers += ["torch 3-D ms"]
    body = []
    for r in rows:
        naive_bytes = r["naive_peak_bytes"]
        gflops = r["flops"] / r["flash_ms"] / 1e6
        skipped = f"skipped (needs {format_bytes(r['naive_estimate_bytes'])})"
        line: list[Any] = [
            r["tokens"],
            r["score_matrix_bytes"] / benchmark.MiB,
            r["naive_ms"] if r["naive_ms"] is not None else skipped,
            r["tiles"],
            r["flash_ms"],
            benchmark.ratio(r["naive_ms"], r["flash_ms"]),
            None if naive_bytes is None else naive_bytes / benchmark.MiB,
            r["naive_estimate_bytes"] / benchmark.MiB,
            r["flash_peak_bytes"] / benchmark.MiB,
            r["flash_estimate_bytes"] / benchmark.MiB,
            gflops,
            f"{gflops / r['matmul_gflops']:.0%}",
        ]
        if causal:
            line += [r["flash_no_mask_ms"], r["flash_ms"] / r["flash_no_mask_ms"]]
        if args.torch:
            # the same FLOPs, torch's time
            torch_share = r["flops"] / r["torch_ms"] / 1e6 / r["matmul_gflops"]
            line += [r["torch_ms"], f"{torch_share:.0%}", r["flash_ms"] / r["torch_ms"]]
        if args.torch_3d:
            line += [r["torch_3d_ms"]]
        body.append([benchmark.cell(x) for x in line])
    # formatted here, not by tabulate: a "skipped" string in a column stops tabulate rounding that column
    print(machine.marked_table(body, rows, headers, args.format, width=table_width(args)))


def flash_tiles(args: argparse.Namespace, T: int) -> tuple[int, int, int]:
    """(block_q, block_k, kv heads per step) that flash runs at T: the flags', else the defaults."""
    diagonal = None if args.no_causal else 0
    block_q, block_k, per_step = default_tiles(T, T, 1, block_q=args.block_q, block_k=args.block_k, diagonal=diagonal)
    return min(block_q, T), min(block_k, T), args.kv_heads_per_step or per_step


def tiles_text(args: argparse.Namespace, T: int) -> str:
    """The flash tile settings of a run, as the header of its table says them."""
    block_q, block_k, per_step = flash_tiles(args, T)
    chosen = "given" if args.block_q or args.block_k or args.kv_heads_per_step else "default"
    return f"tiles {block_q} x {block_k} with {min(per_step, args.heads)} heads per step ({chosen} at T={T:,})"


def plot(rows: list[dict[str, Any]], path: str, args: argparse.Namespace) -> None:
    """Time and traced peak against T, log-log, with T² and T slopes through the last points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = np.array([r["tokens"] for r in rows], float)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines = (
        (ax_t, "naive_ms", "naive (reference)", 1),
        (ax_t, "flash_ms", "flash", 1),
        (ax_t, "torch_ms", "torch SDPA", 1),
        (ax_m, "naive_peak_bytes", "naive peak", benchmark.MiB),
        (ax_m, "flash_peak_bytes", "flash peak", benchmark.MiB),
    )
    for ax, key, label, unit in lines:
        points = [(r["tokens"], r[key] / unit) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=label)
    # reference slopes: T² through the last naive point (or flash's), T through the last flash point
    naive_rows = [r for r in rows if r["naive_ms"] is not None]
    for ax, (naive_key, flash_key, unit, name) in (
        (ax_t, ("naive_ms", "flash_ms", 1, "ms")),
        (ax_m, ("naive_peak_bytes", "flash_peak_bytes", benchmark.MiB, "MiB")),
    ):
        quad_row, quad_key = (naive_rows[-1], naive_key) if naive_rows else (rows[-1], flash_key)
        quad_y = quad_row[quad_key] / unit
        ax.plot(tokens, quad_y * (tokens / quad_row["tokens"]) ** 2, "k--", lw=0.8, label="∝ T²")
        ax.plot(tokens, rows[-1][flash_key] / unit * (tokens / tokens[-1]), "k:", lw=0.8, label="∝ T")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel(name)
        ax.legend()
    ax_t.set_title(f"time, {args.heads} heads x {args.head_dim}, {args.dtype}")
    ax_m.set_title("traced peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def print_results(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    """The table, the growth per doubling, what 'of matmul' means, and the plot (of a run not cut short)."""
    print_table(rows, args, run.causal)
    naive, flash = benchmark.growth_line(rows, "naive_ms"), benchmark.growth_line(rows, "flash_ms")
    print(f"time growth per doubling: {machine.concluded(rows, f'naive {naive}; flash {flash}')}")
    print(
        "useful FLOPs = 2·(E + Ev) per unmasked score (QKᵀ and PV); 'of matmul' = flash GFLOP/s / the GFLOP/s of\n"
        f"one 2048 x 2048 {args.dtype} matmul measured just before that row (same BLAS threads): the share of this\n"
        "machine's matmul rate that flash reaches (over 100%: the load changed between the two); 'torch of matmul'\n"
        "the same for torch's time."
    )
    if args.plot and len(rows) == len(run.sizes):  # a picture of a run cut short would replace a whole one
        plot(rows, args.plot, args)


def title(args: argparse.Namespace, run: SimpleNamespace) -> str:
    mask, tiles = "causal" if run.causal else "no mask", tiles_text(args, run.sizes[-1])
    turns = f"; flash's and torch's of {args.rounds} turns of {args.repeats} runs each, the two alternating;\n"
    return (
        f"\n1 sequence, {args.heads} heads x {args.head_dim}, {args.dtype}, {mask}; flash {tiles}, {run.threads} "
        f"workers;\nmedian of {args.repeats} runs{turns if args.torch else '; '}peaks from tracemalloc, (est.) = "
        f"tinyattn_np.memory; naive budget {format_bytes(run.budget)}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = benchmark.start_benchmark(args, run_flops, torch_runner if args.torch else None)
    run.budget = benchmark.naive_budget(args)
    return benchmark.measure_rows(args, run, run.sizes, measure_row, print_results, title(args, run))


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
