"""The GPU table of "Train a Tiny GPT at Home, Part 2: Attention": naive torch attention vs torch's fused
SDPA, float16, causal, as T doubles.

    python torch_crosscheck/gpu_scaling.py                            # 4 heads x 64, T = 256 .. 32,768
    python torch_crosscheck/gpu_scaling.py --memory-limit-gib 8       # an 8 GiB card's out-of-memory row
    python torch_crosscheck/gpu_scaling.py --heads 32 --head-dim 128  # a Llama-3-8B-sized layer

    naive:  scores = q kᵀ / √d                        (B, H, T, T)
            future = triu(ones(T, T), diagonal=1)      (T, T) bool: the keys after each query
            masked = scores.masked_fill(future, -inf)  (B, H, T, T)  a second matrix
            weights = softmax(masked)                  (B, H, T, T)  a third, while the first two live
            out = weights v                            (B, H, T, d)
    fused:  F.scaled_dot_product_attention(q, k, v, is_causal=True): a fused kernel that never holds
            the T x T matrix

The naive path is the article's code (its MultiHeadAttention with fused=False), so it holds about
3 + 1/(2·H) times the score matrix at its peak: 3.1x at 4 heads in float16. --no-causal drops the mask
on both sides (then naive holds scores and weights: 2x). T starts at 256 and doubles up to
--max-tokens. A size that runs out of GPU memory shows OOM and the run goes on (fused keeps going long
after naive stops fitting). Per row: time (median of --repeats runs after one warm-up) and the memory a
call adds (torch.cuda.max_memory_allocated during the call minus what was allocated before it: q, k
and v are not counted, the output is), beside tinyattn_np.memory's score-matrix bytes.

--memory-limit-gib N caps this process's share of the GPU (torch.cuda.set_per_process_memory_fraction),
so that a large GPU shows where a card of N GiB runs out.

Without CUDA it says so and exits 0: there is nothing to measure. Ctrl-C prints the rows measured so far
and exits 130.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the script still answers --help, and says what is missing
    torch = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the scripts' shared modules
from benchmark import doubling, growth  # noqa: E402
from interrupts import interrupted, measure_each, run_main  # noqa: E402
from machine import code_version  # noqa: E402

from tinyattn_np.memory import score_matrix_bytes  # noqa: E402
from tinyattn_np.report import add_format_argument, table  # noqa: E402

OOM = "OOM"
MiB = 2**20
MAX_TOKENS = 2**22  # 4M tokens: the score matrix of one head would be 32 TiB; anything larger is a typo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Naive torch attention (the article's causal masked_fill) vs torch SDPA (is_causal=True) in "
        "float16 on a CUDA GPU, T from 256 doubling: time and the memory each call adds, beside "
        "tinyattn_np.memory's score-matrix bytes."
    )
    parser.add_argument("--max-tokens", type=int, default=32768, help="largest T (default: 32768, the article's)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads H (default: 4, the article's)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size d (default: 64, the article's)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell, median shown (default: 3)")
    parser.add_argument(
        "--no-causal", action="store_true", help="no mask on either side (naive then holds 2x the score matrix)"
    )
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="cap this process at N GiB of the GPU, e.g. 8 for the article's 8 GB card (default: no cap)",
    )
    add_format_argument(parser)
    args = parser.parse_args(argv)
    for name in ("max_tokens", "heads", "head_dim", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int; got {getattr(args, name)}")
    if args.max_tokens > MAX_TOKENS:
        parser.error(f"--max-tokens must be at most {MAX_TOKENS:,}; got {args.max_tokens:,}")
    if args.memory_limit_gib is not None and not 0 < args.memory_limit_gib < math.inf:
        parser.error(f"--memory-limit-gib must be a positive number of GiB; got {args.memory_limit_gib}")
    return args


def token_counts(max_tokens: int) -> list[int]:
    """256, 512, 1024, ... up to max_tokens (just max_tokens if it is below 256)."""
    return doubling(256, max_tokens) or [max_tokens]


def naive(q: Any, k: Any, v: Any, causal: bool = True) -> Any:
    """softmax(q kᵀ / √d + mask) v as the article writes it: every intermediate a tensor of its own."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        T = q.shape[-2]
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)  # (T, T)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v  # (B, H, T, d); 3 (T, T) alive
    return scores.softmax(-1) @ v  # (B, H, T, d); scores and weights alive at once


def fused(q: Any, k: Any, v: Any, causal: bool = True) -> Any:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, d)


def free_memory() -> None:
    """Drop what a finished or failed run left (an OOM traceback holds its tensors) before the next."""
    gc.collect()
    torch.cuda.empty_cache()


def measure(attend: Callable, q: Any, k: Any, v: Any, causal: bool, repeats: int) -> tuple[float, int] | str:
    """(median seconds, bytes the call added at its peak) of attend(q, k, v), or "OOM"."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # q, k, v and whatever else lives: not the call's
    try:
        out = attend(q, k, v, causal)  # warm-up: kernel selection and autotuning stay out of the timings
        torch.cuda.synchronize()
        del out
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = attend(q, k, v, causal)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del out
    except torch.cuda.OutOfMemoryError:
        return OOM
    return statistics.median(times), torch.cuda.max_memory_allocated() - before


def check_agreement(B: int, H: int, d: int, causal: bool) -> float:
    """naive == fused on 64 tokens before anything is timed; stop with an error if they disagree."""
    q, k, v = (torch.randn(B, H, 64, d, device="cuda", dtype=torch.float16) for _ in range(3))
    diff = (naive(q, k, v, causal).float() - fused(q, k, v, causal).float()).abs().max().item()
    if not diff <= 1e-2:  # float16: a few units of 2^-11 on outputs of size ~1
        sys.exit(f"error: naive and fused disagree on 64 tokens: max |diff| = {diff:.3g}")
    return diff


def measure_row(T: int, args: argparse.Namespace) -> dict[str, Any]:
    """Naive and fused at T: each (ms, MiB) or OOM; a row of OOMs when not even q, k, v fit."""
    B, H, d, causal = args.batch, args.heads, args.head_dim, not args.no_causal
    row: dict[str, Any] = {"tokens": T, "scores_bytes": score_matrix_bytes(T, heads=H, batch=B, dtype="fp16")}
    try:
        q, k, v = (torch.randn(B, H, T, d, device="cuda", dtype=torch.float16) for _ in range(3))
    except torch.cuda.OutOfMemoryError:
        return {**row, "inputs": OOM, "naive": OOM, "fused": OOM}
    for name, attend in (("naive", naive), ("fused", fused)):
        result = measure(attend, q, k, v, causal, args.repeats)
        free_memory()
        row[name] = OOM if result == OOM else (result[0] * 1e3, result[1] / MiB)
    del q, k, v
    free_memory()
    return row


def print_rows(rows: list[dict[str, Any]], fmt: str) -> None:
    body, ratio = [], None
    for r in rows:
        naive_ms, naive_mib = (OOM, OOM) if r["naive"] == OOM else r["naive"]
        fused_ms, fused_mib = (OOM, OOM) if r["fused"] == OOM else r["fused"]
        speedup = f"{naive_ms / fused_ms:.1f}x" if OOM not in (naive_ms, fused_ms) else "-"
        # formatted here: a column that holds "OOM" is text to tabulate, and its floatfmt would not apply
        cells = [f"{x:,.2f}" if x != OOM else OOM for x in (naive_ms, fused_ms)]
        cells += [f"{x:,.1f}" if x != OOM else OOM for x in (naive_mib, fused_mib)]
        body.append([r["tokens"], f"{r['scores_bytes'] / MiB:,.1f}", cells[0], cells[1], speedup, cells[2], cells[3]])
        if naive_mib != OOM:
            ratio = (r["tokens"], naive_mib * MiB / r["scores_bytes"])
    headers = ["tokens", "score matrix MiB", "naive ms", "fused ms", "speed-up", "naive MiB", "fused MiB"]
    print(table(body, headers, fmt=fmt, colalign=["right"] * len(headers), disable_numparse=True))
    print(
        "MiB = 2^20 B; naive/fused MiB: what one call adds at its peak (torch.cuda.max_memory_allocated "
        "minus what was allocated before it; the output counts, q, k and v do not)"
    )
    if ratio is not None:
        print(f"naive MiB / score matrix at T={ratio[0]}: {ratio[1]:.2f}x")
    times = {name: [r[name][0] for r in rows if r[name] != OOM] for name in ("naive", "fused")}
    print(f"time per doubling: naive {growth(times['naive'])}; fused {growth(times['fused'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("torch is not installed: nothing to measure (a CUDA build of torch, on a GPU machine)")
        return 0
    if not torch.cuda.is_available():
        print(
            f"CUDA is not available (torch {torch.__version__} sees no GPU): nothing to measure. "
            "Run this on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
        return 0
    limit = ""
    if args.memory_limit_gib is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        if args.memory_limit_gib * 2**30 > total:
            sys.exit(
                f"error: --memory-limit-gib {args.memory_limit_gib:g} is more than this GPU has "
                f"({total / 2**30:.1f} GiB)"
            )
        torch.cuda.set_per_process_memory_fraction(args.memory_limit_gib * 2**30 / total)
        limit = f"; memory capped at {args.memory_limit_gib:g} GiB"
    diff = check_agreement(args.batch, args.heads, args.head_dim, not args.no_causal)
    print(f"check: naive == fused on 64 tokens (max |diff| {diff:.2e})")
    mask = "non-causal" if args.no_causal else "causal"
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}; float16, "
        f"B={args.batch}, H={args.heads}, d={args.head_dim}, {mask}; time: median of {args.repeats}"
        f"{limit}"
    )
    print(f"code: {code_version()}")
    rows: list[dict[str, Any]] = []
    sizes = token_counts(args.max_tokens)

    def until_both_fail() -> Iterator[int]:
        for T in sizes:
            if rows and rows[-1]["naive"] == rows[-1]["fused"] == OOM:
                return  # both out of memory: a larger T cannot fit either
            yield T

    stopped = measure_each(until_both_fail(), lambda T: measure_row(T, args), rows)
    if rows:
        print_rows(rows, args.format)
    return interrupted(len(rows), len(sizes)) if stopped else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
