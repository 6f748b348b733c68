"""tiles.py --profile: where one forward and one backward of flash attention spend their time
(tinyattn_np.profiler times a copy of each kernel's tile loop, part by part), printed as two tables.
"""

from __future__ import annotations

import argparse
from typing import Any

import benchmark
import interrupts
import machine
import numpy as np
import outputs

from tinyattn_np import profiler
from tinyattn_np.profiler import PARTS, PYTHON
from tinyattn_np.report import table

MATMULS = PARTS[0]


def profile_forward(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The forward's profile (tinyattn_np.profiler) at the flags' size."""
    rate = lambda: machine.matmul_rate(args.dtype, repeats=1)  # noqa: E731
    return profiler.profile_forward(qkv, causal=not args.no_causal, repeats=args.repeats, matmul_rate=rate)


def profile_backward(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The backward's profile (tinyattn_np.profiler) at the flags' size, dout drawn from --seed + 1."""
    rate = lambda: machine.matmul_rate(args.dtype, repeats=1)  # noqa: E731
    return profiler.profile_backward(
        qkv, causal=not args.no_causal, repeats=args.repeats, matmul_rate=rate, seed=args.seed + 1
    )


def print_profile(name: str, row: dict[str, Any], args: argparse.Namespace) -> None:
    """One table: each part per tile and in all, and its share of the copy's run on one thread."""
    plan, tiles, parts, total = row["plan"], row["tiles"], row["parts_ms"], sum(row["parts_ms"].values())
    per_step = getattr(plan, "kv_heads_per_step", None)
    tile = f"{plan.block_q} x {plan.block_k} tiles" + (f", {per_step} kv heads per step" if per_step else "")
    tile += f", heads per item: {row['heads']}" if "heads" in row else ""
    unit, units = ("tile step", "tile steps") if per_step else ("tile of one head", "tiles of one head")
    print(
        f"\n{name}: T={args.tokens:,}, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"{'causal' if not args.no_causal else 'no mask'}; {tile};\n  {tiles:,} {units} on one worker; each part "
        f"the least of {args.repeats} runs"
    )
    body = [[part, 1e3 * parts[part] / tiles, parts[part], f"{parts[part] / total:.0%}"] for part in (*PARTS, PYTHON)]
    body.append(["in all", 1e3 * total / tiles, total, "100%"])
    print(table(body, ["part", f"µs per {unit}", "ms in all", "share"], fmt=args.format, floatfmt=".1f"))
    gflops, rate = row["flops"] / parts[MATMULS] / 1e6, row["matmul_gflops"]
    print(
        f"matmuls: {gflops:.1f} GFLOP/s, {gflops / rate:.0%} of a 2048² {args.dtype} matmul on one BLAS "
        f"thread beside them ({rate:.1f} GFLOP/s, the best of {args.repeats});\n  the kernel itself: "
        f"{row['kernel_ms']:.1f} ms on one worker, {row['all_workers_ms']:.1f} ms on {plan.workers}; the profile's "
        f"copy gives the kernel's bits: {'yes' if row['same_bits'] else 'NO'}"
    )


def profile_main(args: argparse.Namespace) -> int:
    """--profile: the header, the forward's table, then the backward's; Ctrl-C keeps the tables printed."""
    benchmark.check_agreement(args, not args.no_causal)
    info, lines = machine.header()
    print(lines)
    qkv, rows = benchmark.make_qkv(np.random.default_rng(args.seed), args.tokens, args), []
    profiles = {"forward": profile_forward, "backward": profile_backward}
    stopped = interrupts.measure_each(profiles, lambda name: (name, profiles[name](args, qkv)), rows)
    for name, row in rows:
        print_profile(name, row, args)
    busy = machine.busy_reasons()  # the tables and their matmul rates, measured beside other work
    if busy:
        print(f"* measured on a busy machine: compare these figures with care ({'; '.join(busy)})")
    done = dict(rows)
    if args.json:
        outputs.write_json(args.json, {"machine": info, "args": vars(args), **done}, stopped)
    if stopped:
        return interrupts.interrupted(len(done), 2, "tables")
    return 0 if all(row["same_bits"] for row in done.values()) else 1
