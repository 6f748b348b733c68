"""flash_attention's tile sizes and worker counts at one T, what they predict for a 16-core machine, and
where one forward and one backward spend their time.

    python scripts/tiles.py                       # T = 4096, 4 heads of 64, causal, float32
    python scripts/tiles.py --tokens 8192 --repeats 3
    python scripts/tiles.py --profile             # T = 1024: the parts of each kernel (forward, backward, decode)
    python scripts/tiles.py --tune --profile      # the same with this machine's tiles (tinyattn_np.tune)

It times flash at --tokens for square tiles of 128 to 1024 with 1, 2 or 4 kv heads per tile step, on one
worker and on all, and measures what decides many cores: w, the time of one tile step on one thread, and held,
the part of it spent in Python and NumPy's per-call overhead with the interpreter lock held (the same grid and
calls on 2 x 2 tiles with E = 1, where the arithmetic is nil). The last column models a 16-core machine from
measurements made on one (see model_16_cores). The default tiles are marked, and a row measured while the
machine was busy is marked with *.

--profile runs a copy of flash_forward's and the backward's tile loops, and of a decode step's block loop
(flash_decode's engine: the last token's queries against the T keys; and DeepSeek-V3's MLA step, 128 heads
over T latents, absorbed), on one thread, on the tiles the kernels choose, with every NumPy call timed into its
part: the matmuls, the exponentials, the reductions and rescaling, the masking, the copies and set-up. The copy
calls the kernels' own helpers and must give the kernels' bits (checked). "Python between them" is the rest of
the copy's run (the loop, the slicing, the calls), less the timing's own cost. Each part is the least of
--repeats runs, beside the kernel's own time and the best one-thread matmul rate; each table ends with the
kernel's time as a multiple of its products' (the aim: at most 1.25x).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tinyattn_np import flash_attention, tune
from tinyattn_np.blockmask import tile_plan
from tinyattn_np.memory import attention_flops
from tinyattn_np.report import add_wide_argument, positive, table_width
from tinyattn_np.tune import decode_layout, default_tiles

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import benchmark
import interrupts
import kernel_profile
import limits
import machine
import outputs

# the 16-core machine that calibrates the model (T = 8192, 4 heads x 64, causal; measured: docs/results/tiles.md)
CALIBRATION_CORES = 16
CALIBRATION_HELD_S_PER_STEP = 457.4e-3 / 2112  # 16 threads on 256 x 256 tiles: 457.4 ms for 2,112 tile steps
CALIBRATION_PROCESSES_MS, CALIBRATION_PROCESSES_SIDE = (
    64.4,
    512,
)  # 16 processes on (head, 512-query block) items, no lock

SIDES = (128, 256, 512, 1024)  # square tiles
HEADS_PER_STEP = (1, 2, 4)  # kv heads per tile step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokens",
        type=positive(int, limits.MAX_TOKENS),
        help="T, the sequence length (default 4096; 1024 with --profile)",
    )
    p.add_argument("--profile", action="store_true", help="split one forward and one backward at T into their parts")
    p.add_argument("--tune", action="store_true", help="first tinyattn_np.tune(): tiles, workers, decode layout")
    benchmark.add_shape_arguments(p, tokens_range=False, repeats=3)
    add_wide_argument(p)
    args = p.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.profile else 4096)
    benchmark.check_sizes(p, args, args.tokens, flag="--tokens")
    return args


def run_flops(args: argparse.Namespace, sizes: list[int], causal: bool) -> float:
    """FLOPs of the whole sweep, for the refusal of a run too long: every tile shape on two worker counts."""
    flops = attention_flops(sizes[0], heads=args.heads, head_dim=args.head_dim, causal=causal)
    return (args.repeats + 2) * 2 * (len(SIDES) + 1) * len(HEADS_PER_STEP) * flops  # + 1: the default's side


def sweep_items(T: int, side: int, heads: int, per_step: int, causal: bool) -> list[int]:
    """The tile steps of each work item (kv heads of one step x one query block),
    as flash_attention makes them."""
    plan = tile_plan(T, T, side, side, causal=causal)
    per_block = [sum(1 for t in plan if t.q_start == q_start) for q_start in range(0, T, side)]
    return [n for n in per_block for _ in range(-(-heads // per_step))]


def makespan(items: list[int], workers: int) -> int:
    """Steps of the busiest worker when each free worker takes the next item,
    longest first (as flash does)."""
    loads = [0] * workers
    for n in sorted(items, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads)


def held_us_per_step(T: int, side: int, causal: bool, repeats: int) -> float:
    """Microseconds per tile step of Python and NumPy's per-call overhead, the interpreter lock held: the same
    tiles and calls per step on 2 x 2 tiles of E = 1, where the arithmetic is nil (NumPy's loops let go of the
    lock only for larger arrays). The call's own cost (checks, set-up) is measured on one tile and taken off."""

    def ms_for(n_blocks: int) -> float:
        x = np.random.default_rng(0).standard_normal((1, 2 * n_blocks, 1))
        call = lambda: flash_attention(x, x, x, causal=causal, block_q=2, block_k=2, workers=1)  # noqa: E731
        return machine.settled_median_ms(call, max(repeats, 5))

    n_blocks = -(-T // side)
    steps = len(tile_plan(2 * n_blocks, 2 * n_blocks, 2, 2, causal=causal))
    return max(ms_for(n_blocks) - ms_for(1), 0.0) * 1e3 / max(steps - 1, 1)


def measure_row(shape: tuple[int, int], args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """One tile shape (side, kv heads per step): its steps and items, its time on 1 and on all workers,
    w and held per step (held is measured once per side), and the matmul rate beside it."""
    side, per_step = shape
    T, causal, cores = args.tokens, not args.no_causal, os.cpu_count() or 1
    if side not in run.held:
        run.held[side] = held_us_per_step(T, side, causal, args.repeats)
    items = sweep_items(T, side, args.heads, per_step, causal)
    row: dict[str, Any] = dict(side=side, per_step=per_step, steps=sum(items), items=len(items))
    row["held_us"] = run.held[side]
    row.update(machine.beside_the_row(args.dtype, run.rate))
    q, k, v = run.qkv
    for workers in sorted({1, cores}):
        outputs.progress(f"  side={side} kv_heads_per_step={per_step} workers={workers}")

        def call(workers: int = workers) -> None:
            flash_attention(
                q,
                k,
                v,
                causal=causal,
                block_q=side,
                block_k=side,
                kv_heads_per_step=per_step,
                workers=workers,
            )

        row[f"ms_{workers}"] = machine.settled_median_ms(call, args.repeats)
    row["w_us"] = row["ms_1"] * 1e3 / row["steps"]
    row["span_16"] = makespan(items, CALIBRATION_CORES)
    return row


def model_16_cores(rows: list[dict[str, Any]], args: argparse.Namespace) -> float | None:
    """Fill each row's Amdahl ceiling and 16-core prediction; return kappa (None without its base row).

    Per tile step: w, the time of one step on one thread, and held, the part of it with the interpreter lock
    held (held_us_per_step). Amdahl: with f = held / w, N threads run at most 1 / (f + (1 - f) / N) times
    faster. The 16-core measurements add what Amdahl leaves out: 16 threads handing the lock around take
    CALIBRATION_HELD_S_PER_STEP per step (wake-ups, not the calls themselves), and cores that all compute at
    once run slower than one alone (kappa, from the 16-process run against this machine's w for the same tiles,
    one head a step: a step's time depends on its tile, not on T). Predicted time on 16 cores:
        max(steps · held_16, kappa · w · makespan of the items on 16 workers)
    """
    base = next((r for r in rows if r["side"] == CALIBRATION_PROCESSES_SIDE and r["per_step"] == 1), None)
    calibration_span = makespan(sweep_items(8192, CALIBRATION_PROCESSES_SIDE, 4, 1, True), CALIBRATION_CORES)
    usable = base is not None and args.head_dim == 64  # the 16-process run's tiles had E = 64
    kappa = CALIBRATION_PROCESSES_MS / (base["w_us"] * calibration_span / 1e3) if usable else None
    for r in rows:
        f = r["held_us"] / r["w_us"]
        r["amdahl_16"] = 1 / (f + (1 - f) / CALIBRATION_CORES)
        held_ms, compute_ms = (
            r["steps"] * CALIBRATION_HELD_S_PER_STEP * 1e3,
            (kappa or 0) * r["w_us"] * r["span_16"] / 1e3,
        )
        r["predicted_16_ms"] = max(held_ms, compute_ms) if kappa else None
    return kappa


def print_sweep(rows: list[dict[str, Any]], args: argparse.Namespace, run: Any) -> None:
    """The sweep's table with the 16-core model filled in (model_16_cores), the fastest row and the model."""
    kappa = model_16_cores(rows, args)
    run.extra = {"kappa": kappa}  # for --json
    T, causal, cores, rate = args.tokens, not args.no_causal, os.cpu_count() or 1, run.rate
    flops = attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal)
    default, sixteen = (
        (side, side, min(per_step, args.heads))  # no more heads per step than there are heads
        for side, _, per_step in (
            default_tiles(T, T, 1, cores=n, diagonal=0 if causal else None) for n in (cores, CALIBRATION_CORES)
        )
    )
    body = [sweep_cells(r, cores, flops / r[f"ms_{cores}"] / 1e6, rate, default) for r in rows]
    print(
        f"\nflash_attention at T={T}, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"{'causal' if causal else 'no mask'}; median of {args.repeats}; 'ms, {cores} w' = {cores} workers"
    )
    headers = ["tiles", "heads/step", "steps", "items", "ms, 1 w", f"ms, {cores} w", "GFLOP/s", "of matmul"]
    headers += ["w µs/step", "held µs/step", "Amdahl x16", "16-core ms (model)"]
    label = lambda r: f"{r['side']} x {r['side']}, {per_step(r['per_step'])}"  # noqa: E731
    print(machine.marked_table(body, rows, headers, args.format, label, floatfmt=".1f", width=table_width(args)))
    best = min(rows, key=lambda r: r[f"ms_{cores}"])
    fastest = f"{best['side']} x {best['side']}, {per_step(best['per_step'])} ({best[f'ms_{cores}']:.1f} ms"
    fastest += f" on {cores} workers)"
    print(
        f"fastest here: {machine.concluded(rows, fastest)};\nthe default at this shape on this machine: "
        f"{default[0]} x {default[1]}, {per_step(default[2])};\non 16 cores: {sixteen[0]} x {sixteen[1]}, "
        f"{per_step(sixteen[2])} (tune.default_tiles)"
    )
    if kappa:
        held, side = CALIBRATION_HELD_S_PER_STEP * 1e6, CALIBRATION_PROCESSES_SIDE
        print(
            f"model: held_16 = {held:.0f} µs per step (16 threads, 256 x 256, one head a step: "
            f"457.4 ms / 2,112 steps);\nkappa = {kappa:.2f} ({CALIBRATION_PROCESSES_MS} ms for 16 processes on "
            f"{side} x {side} tiles against this machine's w);\nAmdahl x16 leaves the "
            "lock hand-offs out and is a ceiling only"
        )


def sweep_cells(r: dict[str, Any], cores: int, gflops: float, rate: float, default: tuple[int, ...]) -> list[Any]:
    """One row of the sweep's table: the tiles (the default marked), the steps and items,
    the times, the rate."""
    mark = " (default)" if (r["side"], r["side"], r["per_step"]) == default else ""
    cells = [f"{r['side']} x {r['side']}{mark}", r["per_step"], r["steps"], r["items"], r["ms_1"], r[f"ms_{cores}"]]
    return cells + [gflops, f"{gflops / rate:.0%}", r["w_us"], r["held_us"], r["amdahl_16"], r["predicted_16_ms"]]


def per_step(n: int) -> str:
    """'1 kv head per step', '4 kv heads per step': a tile step's kv heads, each with its query heads."""
    return f"{n} kv head{'' if n == 1 else 's'} per step"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tune:
        outputs.progress("tuning (tinyattn_np.tune)")
        print(f"tuned: {tune()}; decode: {decode_layout()}")
    if args.profile:
        return kernel_profile.profile_main(args)
    run = benchmark.start_benchmark(args, run_flops)
    side = default_tiles(args.tokens, args.tokens, 1, diagonal=None if args.no_causal else 0)[0]  # swept too
    shapes = [(s, per_step) for s in sorted({*SIDES, side}) for per_step in HEADS_PER_STEP if per_step <= args.heads]
    run.qkv, run.held = benchmark.make_qkv(np.random.default_rng(args.seed), args.tokens, args), {}
    return benchmark.measure_rows(args, run, shapes, measure_row, print_sweep)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
