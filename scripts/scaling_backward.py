"""The backward's bill, measured: flash_attention_backward as T doubles, beside flash's forward.

    python scripts/scaling_backward.py                     # 1 sequence, 4 heads of 64, causal, T up to 8192
    python scripts/scaling_backward.py --torch             # and torch's CPU backward (autograd through SDPA)

Per row: flash's forward and backward times, their ratio, the backward's GFLOP/s, its traced peak beside
peaks.flash_attention_backward_bytes, and with --torch torch's backward on the same q, k, v and dout.
Every time is the median of --repeats runs after two warm-ups; with --torch, flash's backward and torch's take
turns, --rounds turns of --repeats runs each, so that a machine whose speed drifts during a row slows both
alike. A row measured while the machine was busy (its matmul rate moved by more than 20%, or the load
exceeded the cores) is marked with *.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import flash_attention, flash_attention_backward
from tinyattn_np.measure import alternating_medians_ms, traced_peak
from tinyattn_np.memory import attention_backward_flops, attention_flops
from tinyattn_np.peaks import flash_attention_backward_bytes
from tinyattn_np.report import add_wide_argument, positive, table_width
from tinyattn_np.tune import backward_side

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import benchmark
import interrupts
import limits
import machine
import outputs
import torch_import


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_shape_arguments(p)
    benchmark.add_flash_arguments(p, per_step=False)
    add_wide_argument(p)
    p.add_argument("--torch", action="store_true", help="add torch's CPU backward (autograd through SDPA; needs torch)")
    p.add_argument(
        "--rounds",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="with --torch: turns of --repeats runs each, flash's backward and torch's alternating (default 3)",
    )
    args = p.parse_args(argv)
    benchmark.check_sizes(p, args, args.max_tokens)
    return args


def run_flops(args: argparse.Namespace, sizes: list[int], causal: bool) -> float:
    """FLOPs of the whole run, for the refusal of a run too long: per row the forward, the backward's 2.5x the
    forward's FLOPs, and with --torch both backwards --rounds turns of --repeats runs after two warm-ups."""
    masked = sum(attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal) for T in sizes)
    backward_runs = 2 * args.rounds * (args.repeats + 2) if args.torch else args.repeats + 3
    return (args.repeats + 3 + 2.5 * backward_runs) * masked


def torch_backward_runner(threads: int) -> tuple[Any, str]:
    """(a function (q, k, v, dout, causal) -> a call that runs torch's backward alone, torch's version):
    the forward runs once, with autograd recording, and each call back-propagates dout through it again."""
    torch, F = torch_import.load_torch(threads)

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, causal: bool) -> Any:
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))  # 4-D: torch's fast CPU path
        tdout = torch.from_numpy(dout)
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        def backward() -> None:
            tq.grad = tk.grad = tv.grad = None  # fresh gradients each time, not accumulated ones
            out.backward(tdout, retain_graph=True)  # retain_graph: the same graph serves every call

        return backward

    return run, torch.__version__


def measure_row(T: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """Flash's forward and backward at T (time, GFLOP/s, traced peak beside the estimate),
    and torch's backward."""
    outputs.progress(f"T = {T}")
    rng = np.random.default_rng(args.seed + T)
    q, k, v = benchmark.make_qkv(rng, T, args)
    dout = rng.standard_normal(q.shape, dtype=np.dtype(args.dtype))
    causal, blocks = run.causal, run.blocks
    sizes = dict(heads=args.heads, head_dim=args.head_dim, causal=causal)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, **blocks)
    row: dict[str, Any] = {
        "tokens": T,
        "tiles": backward_tiles(T, causal, args),
        "forward_flops": attention_flops(T, **sizes),
        "backward_flops": attention_backward_flops(T, **sizes),
        "backward_estimate_bytes": flash_attention_backward_bytes(T, **sizes, dtype=args.dtype, **blocks),
    }
    row.update(machine.beside_the_row(args.dtype, run.rate))  # did the machine stay as quiet as it was?
    outputs.progress(f"  T={T}: flash forward")
    forward = lambda: flash_attention(q, k, v, causal=causal, return_lse=True, **blocks)  # noqa: E731
    row["forward_ms"] = machine.settled_median_ms(forward, args.repeats)
    outputs.progress(f"  T={T}: flash backward" + (" and torch's, in turns" if run.torch else ""))
    backward = lambda: flash_attention_backward(q, k, v, out, dout, lse, causal=causal, **blocks)  # noqa: E731
    if run.torch is None:
        row["backward_ms"] = machine.settled_median_ms(backward, args.repeats)
    else:  # turns: a machine whose speed drifts during the row slows both alike
        row["backward_ms"], row["torch_backward_ms"] = alternating_medians_ms(
            [backward, run.torch(q, k, v, dout, causal)],
            args.repeats,
            args.rounds,
            idle=machine.SETTLE_SECONDS,
        )
    row["backward_peak_bytes"] = traced_peak(backward)[1]
    return row


def backward_tiles(T: int, causal: bool, args: argparse.Namespace) -> str:
    """The backward's tiles at T: the given --block-q and --block-k, else the default
    (tune.backward_side)."""
    side = backward_side(T, 0 if causal else None)
    return f"{args.block_q or side} x {args.block_k or side}"


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    headers = ["tokens", "tiles", "forward ms", "backward ms", "bwd/fwd", "bwd GFLOP/s", "bwd peak MiB"]
    headers += ["(est.)", "peak/est."]
    if args.torch:
        headers += ["torch bwd ms", "flash/torch bwd"]
    body = []
    for r in rows:
        line = [
            str(r["tokens"]),
            r["tiles"],
            f"{r['forward_ms']:.1f}",
            f"{r['backward_ms']:.1f}",
            f"{r['backward_ms'] / r['forward_ms']:.2f}",
            f"{r['backward_flops'] / r['backward_ms'] / 1e6:.1f}",
            f"{r['backward_peak_bytes'] / benchmark.MiB:.1f}",
            f"{r['backward_estimate_bytes'] / benchmark.MiB:.1f}",
            f"{r['backward_peak_bytes'] / r['backward_estimate_bytes']:.2f}",
        ]
        if args.torch:
            line += [f"{r['torch_backward_ms']:.1f}", f"{r['backward_ms'] / r['torch_backward_ms']:.2f}"]
        body.append(line)
    print(machine.marked_table(body, rows, headers, args.format, width=table_width(args)))
    print("backward FLOPs = 2·(3E + 2Ev) per unmasked score (S again, dV, dP, dQ, dK: 2.5x the forward's 2·(E + Ev))")
    if args.torch:
        print("torch bwd = autograd's backward through F.scaled_dot_product_attention on 4-D tensors, forward excluded")


def title(args: argparse.Namespace, run: SimpleNamespace) -> str:
    mask, blocks = "causal" if run.causal else "no mask", "as the tiles column says"
    turns = f"; the backwards' of {args.rounds} turns of {args.repeats} runs each, flash's and torch's alternating;\n"
    return (
        f"\nflash_attention_backward: 1 sequence, {args.heads} heads x {args.head_dim}, {args.dtype}, {mask}; blocks "
        f"{blocks}, {run.threads} workers;\nmedian of {args.repeats} runs{turns if args.torch else '; '}peak from "
        "tracemalloc, (est.) = memory.flash_attention_backward_bytes"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = benchmark.start_benchmark(args, run_flops, torch_backward_runner if args.torch else None)
    run.blocks = dict(block_q=args.block_q, block_k=args.block_k, workers=args.workers)  # None: the defaults
    return benchmark.measure_rows(args, run, run.sizes, measure_row, print_table, title(args, run))


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
