"""The GPU table: naive attention in torch vs torch's fused SDPA, in float16, as T doubles.

    python torch_crosscheck/gpu_scaling.py [--max-tokens 65536] [--heads 32] [--head-dim 128]

    naive:  scores = q kᵀ / √d   (B, H, T, T)     the whole score matrix, in fp16
            weights = softmax(scores)  (B, H, T, T)   a second one while the first is alive
            out = weights v       (B, H, T, d)
    SDPA:   torch.nn.functional.scaled_dot_product_attention(q, k, v): a fused kernel (FlashAttention
            or memory-efficient) that never holds the T x T matrix

Both are non-causal, so the naive path needs no mask and the memory difference is the score matrix.
T starts at 256 and doubles up to --max-tokens. A size that runs out of GPU memory is shown as OOM and
the run goes on with the next one (SDPA keeps going long after naive stops fitting). Per row: time
(median of --repeats runs after one warm-up) and torch.cuda.max_memory_allocated, beside memory.py's
score-matrix bytes for the same shape.

Without CUDA it says so and exits 0: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the script still answers --help, and says what is missing
    torch = None

from tinyattn_np.memory import score_matrix_bytes
from tinyattn_np.report import add_format_argument, format_bytes, table

OOM = "OOM"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Naive torch attention vs torch SDPA in float16 on a CUDA GPU, T from 256 doubling: "
        "time and torch.cuda.max_memory_allocated per row, beside tinyattn_np.memory's score-matrix bytes."
    )
    parser.add_argument("--max-tokens", type=int, default=65536, help="largest T (default: 65536)")
    parser.add_argument("--heads", type=int, default=32, help="attention heads H (default: 32, as Llama-3-8B)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size d (default: 128)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell, median shown (default: 3)")
    add_format_argument(parser)
    args = parser.parse_args(argv)
    for name in ("max_tokens", "heads", "head_dim", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int; got {getattr(args, name)}")
    return args


def token_counts(max_tokens: int) -> list[int]:
    """256, 512, 1024, ... up to max_tokens (just max_tokens if it is below 256)."""
    counts, T = [], 256
    while T <= max_tokens:
        counts.append(T)
        T *= 2
    return counts or [max_tokens]


def naive(q, k, v):
    """softmax(q kᵀ / √d) v, written out: every intermediate is a torch tensor of its own."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, T), alive together with scores
    return weights @ v  # (B, H, T, d)


def free_memory() -> None:
    """Drop what a finished or failed run left (an OOM traceback holds its tensors) before the next."""
    gc.collect()
    torch.cuda.empty_cache()


def measure(attend: Callable, q, k, v, repeats: int) -> tuple[float, int] | str:
    """(median seconds, peak bytes allocated) of attend(q, k, v), or "OOM" if it ran out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        out = attend(q, k, v)  # warm-up: kernel selection and autotuning stay out of the timings
        torch.cuda.synchronize()
        del out
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = attend(q, k, v)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del out
    except torch.cuda.OutOfMemoryError:
        return OOM
    return statistics.median(times), torch.cuda.max_memory_allocated()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("torch is not installed: nothing to measure (pip install torch, a CUDA build, on a GPU machine)")
        return 0
    if not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__} sees no GPU): nothing to measure. "
              "Run this on a machine with an NVIDIA GPU and a CUDA build of torch.")  # fmt: skip
        return 0

    B, H, d = args.batch, args.heads, args.head_dim
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"float16, B={B}, H={H}, d={d}, non-causal; time: median of {args.repeats}")  # fmt: skip
    rows = []
    for T in token_counts(args.max_tokens):
        estimate = format_bytes(score_matrix_bytes(T, heads=H, batch=B, dtype="fp16"))
        try:
            q, k, v = (torch.randn(B, H, T, d, device="cuda", dtype=torch.float16) for _ in range(3))
        except torch.cuda.OutOfMemoryError:
            rows.append([T, OOM, OOM, OOM, OOM, estimate])  # not even q, k and v fit: stop here
            break
        cells = []
        for attend in (naive, F.scaled_dot_product_attention):
            result = measure(attend, q, k, v, args.repeats)
            free_memory()
            cells += [OOM, OOM] if result == OOM else [f"{result[0] * 1e3:,.2f}", format_bytes(result[1])]
        del q, k, v
        free_memory()
        rows.append([T, *cells, estimate])
        if cells[0] == cells[2] == OOM:
            break  # both out of memory: a larger T cannot fit either
    headers = ["T", "naive ms", "naive peak", "SDPA ms", "SDPA peak", "score matrix (memory.py)"]
    print(table(rows, headers, fmt=args.format, colalign=["right"] * len(headers)))
    print("peak: torch.cuda.max_memory_allocated, q, k, v and out included (binary units: MiB = 2^20 B); "
          "naive holds the scores and the weights at once, so its peak is about twice the score matrix")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
