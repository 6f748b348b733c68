"""The CPU table of "Train a Tiny GPT at Home, Part 2: Attention": torch naive against torch fused, ours beside.

    python scripts/torch_naive.py                  # 1 sequence, 4 heads of 64, causal, float32, T up to 8192
    python scripts/torch_naive.py --no-causal      # the same without the mask

The article times its naive PyTorch attention (q kᵀ, a causal masked_fill, softmax, @ v: the score matrix
three times over) against torch's fused F.scaled_dot_product_attention. This script does the same on the
CPU, and times our two NumPy paths on the same inputs in the same run: attention() (the reference, which
builds the scores once) and flash_attention(). Needs torch (without it, it says how to install the CPU build).
Every time is the median of --repeats runs after two warm-ups; naive rows over --mem-budget are skipped.
A row measured while the machine was busy is marked with *.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import attention, flash_attention, format_bytes, naive_attention_bytes
from tinyattn_np.memory import attention_flops, score_matrix_bytes
from tinyattn_np.report import add_wide_argument, max_diff, table_width

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import benchmark
import interrupts
import machine
import outputs
import torch_import


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_shape_arguments(p)
    benchmark.add_flash_arguments(p)
    benchmark.add_budget_argument(p)
    add_wide_argument(p)
    args = p.parse_args(argv)
    benchmark.check_sizes(p, args, args.max_tokens)
    return args


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


def check_torch_naive(args: argparse.Namespace) -> float:
    """torch naive == torch fused (SDPA) on 64 tokens before anything is timed; stop if they disagree."""
    torch, F = torch_import.load_torch(args.workers)
    q, k, v = (torch.from_numpy(x) for x in benchmark.make_qkv(np.random.default_rng(args.seed), 64, args))
    causal = not args.no_causal
    diff = max_diff(torch_naive(q, k, v, causal), F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    if not diff <= tol:
        sys.exit(f"error: torch naive and torch fused disagree on 64 tokens: max |diff| = {diff:.3g} > {tol:g}")
    return diff


def run_flops(args: argparse.Namespace, sizes: list[int], causal: bool) -> float:
    """FLOPs of the whole run, for the refusal of a run too long: both naive paths compute every score, the
    fused ones only the unmasked."""
    full = sum(attention_flops(T, heads=args.heads, head_dim=args.head_dim) for T in sizes)
    masked = sum(attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal) for T in sizes)
    return (args.repeats + 2) * 2 * (full + masked)


def measure_row(T: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """The four times of one row: torch naive and fused, our naive and flash (naive ones within budget)."""
    torch, F = torch_import.load_torch(args.workers)
    outputs.progress(f"T = {T}")
    q, k, v = benchmark.make_qkv(np.random.default_rng(args.seed + T), T, args)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))  # shares the memory, no copy
    causal = run.causal
    blocks = benchmark.flash_knobs(args)  # block_q, block_k, workers, kv_heads_per_step
    row: dict[str, Any] = {
        "tokens": T,
        "score_matrix_bytes": score_matrix_bytes(T, heads=args.heads, dtype=args.dtype),
    }
    row.update(machine.beside_the_row(args.dtype, run.rate))  # did the machine stay as quiet as it was?
    fused = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
    outputs.progress(f"  T={T}: torch fused, our flash")
    row["torch_ms"] = machine.settled_median_ms(fused, args.repeats)
    row["flash_ms"] = machine.settled_median_ms(lambda: flash_attention(q, k, v, causal=causal, **blocks), args.repeats)
    row["torch_naive_ms"] = row["naive_ms"] = None
    if torch_naive_bytes(T, args.heads, args.dtype, causal) <= run.budget:
        outputs.progress(f"  T={T}: torch naive")
        row["torch_naive_ms"] = machine.settled_median_ms(lambda: torch_naive(tq, tk, tv, causal), args.repeats)
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=causal)
    if naive_attention_bytes(T, **dims) <= run.budget:
        outputs.progress(f"  T={T}: our naive")
        row["naive_ms"] = machine.settled_median_ms(lambda: attention(q, k, v, causal=causal), args.repeats)
    return row


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    """The article's CPU table (tokens, score matrix, naive ms, fused ms, speed-up), with torch on both
    sides as in the article, and our two paths beside it from the same rows."""
    causal, threads = run.causal, run.threads
    print(
        f"\nThe article's CPU table: torch naive (q kᵀ, {'causal masked_fill, ' if causal else ''}softmax, @ v) vs "
        f"torch fused (SDPA{', is_causal=True' if causal else ''}),\n{args.dtype}, {args.heads} heads x "
        f"{args.head_dim}, {threads} threads; ours beside it (same inputs, same run); median of {args.repeats} runs"
    )
    headers = ["tokens", "scores MiB", "torch naive ms", "torch fused ms", "speed-up", "our naive ms"]
    headers += ["our flash ms", "speed-up", "torch naive / our naive"]
    body, ratio = [], benchmark.ratio
    for r in rows:
        line = [
            r["tokens"],
            r["score_matrix_bytes"] / benchmark.MiB,
            r["torch_naive_ms"],
            r["torch_ms"],
            ratio(r["torch_naive_ms"], r["torch_ms"]),
            r["naive_ms"],
            r["flash_ms"],
            ratio(r["naive_ms"], r["flash_ms"]),
            ratio(r["torch_naive_ms"], r["naive_ms"]),
        ]
        body.append([benchmark.cell(x) for x in line])
    print(machine.marked_table(body, rows, headers, args.format, width=table_width(args)))
    speedups = [x for r in rows if (x := benchmark.ratio(r["torch_naive_ms"], r["torch_ms"])) is not None]
    if speedups:
        low, high = faster(min(speedups)), faster(max(speedups))
        said = f"torch fused is {low if low == high else f'{low} to {high}'} than torch naive here"
        print(machine.concluded(rows, said))
    if any(r["torch_naive_ms"] is None or r["naive_ms"] is None for r in rows):
        budget = format_bytes(benchmark.naive_budget(args))
        print(f"'-': skipped, that naive path would need more than the budget of {budget}")


def faster(speedup: float) -> str:
    """A time ratio (slower time / faster time) in words: 3.52 -> '3.5x faster', 0.25 -> '4.0x slower'."""
    return f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def torch_runner(threads: int) -> tuple[None, str]:  # torch is what this script compares: required
        torch, _ = torch_import.load_torch(threads, flag="torch_naive.py")
        print(f"check: torch naive == torch fused on 64 tokens (max |diff| {check_torch_naive(args):.2e})")
        return None, torch.__version__

    run = benchmark.start_benchmark(args, run_flops, torch_runner)
    run.budget = benchmark.naive_budget(args)
    return benchmark.measure_rows(args, run, run.sizes, measure_row, print_table)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
