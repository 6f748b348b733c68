"""Generating tokens with a KV cache, and without one: the same tokens, linear against quadratic.

What it shows:
  1) a random little model (token table, a few layers of MultiHeadAttention with RoPE, greedy decoding)
     generates --tokens tokens three ways: with a KVCache per layer (each step computes one token's
     k and v and attends 1 x T), by recomputing the whole sequence every step (T x T), and with a
     sliding-window cache of --window tokens (a ring buffer). A table as the context grows: per-token
     time and peak memory of each, the cache bytes in use beside memory.kv_cache_bytes, and whether
     the outputs agree (the same tokens; the cached logits equal the recomputed ones to rounding).
     With --torch, torch SDPA times the same decode step (L = 1 query against S = context keys).
  2) --step: one decode step at a long context (default S = 32,768, 32 query heads over 8 kv heads of
     128, float32) beside its floor, the time to read the cache's bytes once (NumPy sums, one thread and
     two): flash_decode, paged_decode over blocks of 16 and 256 (and of 16 in every other block),
     flash_attention() and attention(); --torch adds SDPA and torch's fastest CPU formulation (matmuls, the
     query heads of each kv head stacked); then 16 sequences of S/32 .. S keys in one paged_decode step
     beside their own floor. The decoding kernels' aims print, met or not: 1.3x the floor, and 1.0x torch's fastest
     (flash_decode's from the two timed in turns too, so that a change in the machine's load slows both alike).
     --layouts adds flash_decode under each block layout tune() chooses among (the layout in force is named).

Run:  python scripts/decode.py [--tokens 248] [--prompt 8] [--window 16] [--torch] [--seed 0]
      python scripts/decode.py --step [--context 32768] [--repeats 5] [--torch] [--layouts]
The weights are random and untrained: the tokens mean nothing; the mechanics are the point.
Every claim is checked; the exit code is 1 (and the failed checks are named) if one fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import (
    KVCache,
    attention,
    flash_decode,
    kv_cache_bytes,
    naive_attention_bytes,
)
from tinyattn_np.masks import window_mask
from tinyattn_np.measure import traced_peak
from tinyattn_np.memory import attention_flops
from tinyattn_np.peaks import flash_attention_bytes
from tinyattn_np.report import (
    Checklist,
    add_seed_and_format,
    add_wide_argument,
    max_diff,
    positive,
    table_width,
)
from tinyattn_np.tune import DECODE_LAYOUTS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import decode_step
import interrupts
import limits
import machine
import outputs
import torch_import
from tiny_decoder import TinyDecoder

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()
MAX_TOKENS = 4096  # recomputing T tokens at every step costs T³ / 3 scores in all: past this, minutes


# ---------------------------------------------------------------------------------------------------
# the little model (tiny_decoder.py)


def windowed_logits(model: TinyDecoder, tokens: list[int], window: int) -> np.ndarray:
    """The whole sequence recomputed under a sliding-window band mask: the reference for the ring buffer."""
    x = model.table[tokens][None]  # (1, T, C)
    band = window_mask(len(tokens), window=window)  # (T, T)
    for block in model.blocks:
        q, k, v = block.split_heads(x)  # (1, H, T, d_head), (1, Hkv, T, d_head) twice
        y = attention(q, k, v, mask=band).swapaxes(1, 2).reshape(x.shape)  # (1, T, C)
        x = x + y @ block.w_out
    return x[0, -1] @ model.table.T  # (V,)


def cache_bytes_in_use(caches: list[KVCache]) -> int:
    """Bytes of the keys and values attention may see now (the views), over all layers."""
    return sum(c.keys.nbytes + c.values.nbytes for c in caches)


# ---------------------------------------------------------------------------------------------------
# 1) generation, three ways


def checkpoints(prompt: int, total: int) -> list[int]:
    """About 8 context lengths, evenly spaced from the prompt to the end, at which a row is printed."""
    step = max(1, (total - prompt) // 8)
    return sorted({*range(prompt + step, total + 1, step), total})


def generate(model: TinyDecoder, args: argparse.Namespace, rng: np.random.Generator, run: Any) -> None:
    """Generate --tokens tokens after a random prompt, three ways at once; at each checkpoint append a row
    to run.rows. run.worst, run.same_tokens and run.window_worst gather the comparisons as it goes, so that
    everything measured stays in `run` when Ctrl-C stops it."""
    total = args.prompt + args.tokens
    tokens = [int(t) for t in rng.integers(0, args.vocab, args.prompt)]
    caches = {"cached": model.caches(total), "window": model.caches(total, args.window)}
    logits = model.logits([tokens], caches["cached"])[0]  # the prompt: one prefill call per cache
    model.logits([tokens], caches["window"])
    marks = checkpoints(args.prompt, total)
    times: dict[str, list[float]] = {"cached": [], "recompute": [], "window": []}
    while len(tokens) < total:
        # 1) the next token from the cached logits; the recomputed logits must give the same one
        token = int(np.argmax(logits))
        tokens.append(token)
        measure = len(tokens) in marks
        steps = {
            "cached": lambda token=token: model.logits([[token]], caches["cached"])[0],
            "recompute": lambda: model.logits([tokens])[0],
            "window": lambda token=token: model.logits([[token]], caches["window"])[0],
        }
        results, peaks = {}, {}
        for name, step in steps.items():
            t0 = time.perf_counter()
            if measure:  # the checkpoint step runs under tracemalloc for its peak; its time is not used
                results[name], peaks[name] = traced_peak(step)
            else:
                results[name] = step()
                times[name].append(time.perf_counter() - t0)
        logits = results["cached"]
        run.worst = max(run.worst, max_diff(logits, results["recompute"]))
        run.same_tokens &= int(np.argmax(results["recompute"])) == int(np.argmax(logits))
        if measure:  # 2) a row, and the window cache checked against a full recompute under the band mask
            windowed = windowed_logits(model, tokens, args.window)
            run.window_worst = max(run.window_worst, max_diff(results["window"], windowed))
            run.rows.append(generation_row(model, args, run, token, times, peaks, caches))
            outputs.progress(f"  context {len(tokens)}: row measured")
            times = {name: [] for name in times}


def generation_row(
    model: TinyDecoder,
    args: argparse.Namespace,
    run: Any,
    token: int,
    times: dict[str, list[float]],
    peaks: dict[str, int],
    caches: dict[str, list[KVCache]],
) -> dict[str, Any]:
    """The figures of one checkpoint: mean ms per token since the last row, traced peaks, cache bytes."""
    context = len(caches["cached"][0])
    block = model.blocks[0]
    sizes = dict(layers=args.layers, kv_heads=block.n_kv_heads, head_dim=block.d_head, dtype=args.dtype)
    row = {
        "context": context,
        **{f"{name}_ms": 1e3 * float(np.mean(times[name])) if times[name] else None for name in times},
        **{f"{name}_peak": peaks[name] for name in peaks},
        "cache_bytes": cache_bytes_in_use(caches["cached"]),
        "kv_cache_bytes": kv_cache_bytes(context, **sizes),
        "window_bytes": cache_bytes_in_use(caches["window"]),
        "window_kv_cache_bytes": kv_cache_bytes(context, window=args.window, **sizes),
        "max_diff": run.worst,
        **machine.beside_the_row(args.dtype, run.rate, n=machine.RATE_SIZE),
    }
    if run.torch_step is not None:
        row.update(run.torch_step(model, caches["cached"][0], token, context))
    return row


def check_generation(run: Any, args: argparse.Namespace) -> None:
    tol = 1e-9 if args.dtype == "float64" else 1e-3
    check(run.same_tokens, "cached and recomputed decoding pick the same token at every step")
    check(run.worst <= tol, f"cached logits equal the recomputed ones (max |diff| {run.worst:.1e} <= {tol:g})")
    check(
        run.window_worst <= tol,
        f"the ring-buffer window equals the band mask (max |diff| {run.window_worst:.1e})",
    )
    exact = all(r["cache_bytes"] == r["kv_cache_bytes"] for r in run.rows)
    check(exact, "the cache holds exactly memory.kv_cache_bytes(context)")
    exact = all(r["window_bytes"] == r["window_kv_cache_bytes"] for r in run.rows)
    check(exact, "the window cache holds exactly memory.kv_cache_bytes(context, window=W)")


def make_torch_step(args: argparse.Namespace) -> Any:
    """A function timing torch SDPA and flash_decode on one layer's decode step (L = 1, S = context)."""
    torch, F = torch_import.load_torch()

    def step(model: TinyDecoder, cache: KVCache, token: int, context: int) -> dict[str, float]:
        block = model.blocks[0]
        q, _, _ = block.split_heads(model.table[[token]][None], positions=[context - 1])  # (1, H, 1, d_head)
        keys, values = cache.keys, cache.values  # (1, Hkv, context, d_head)
        # copies: the views are read-only
        tq, tk, tv = (torch.from_numpy(np.array(x)) for x in (q, keys, values))
        ours = flash_decode(q, keys, values)
        gold = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True).numpy()
        check(max_diff(ours, gold) <= 1e-5, f"flash_decode equals torch SDPA at context {context}")
        # settled: no library's threads still spin from the other's last call
        settled = machine.settled_median_ms
        sdpa = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
        return {
            "ours_step_ms": settled(lambda: flash_decode(q, keys, values), 5),
            "torch_step_ms": settled(sdpa, 5),
        }

    return step


def print_generation(rows: list[dict], args: argparse.Namespace) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def kib(x: int) -> str:
        return f"{x / 1024:,.1f}"

    headers = ["context", "cached ms/token", "recompute ms/token", f"window={args.window} ms/token"]
    headers += ["cached peak KiB", "recompute peak KiB", "cache KiB", "kv_cache_bytes KiB"]
    headers += ["window cache KiB", "max |diff|"]
    if args.torch:
        headers += ["flash_decode step ms", "torch SDPA step ms"]
    table = []
    for r in rows:
        cells = [
            f"{r['context']:,}",
            ms(r["cached_ms"]),
            ms(r["recompute_ms"]),
            ms(r["window_ms"]),
            kib(r["cached_peak"]),
            kib(r["recompute_peak"]),
            kib(r["cache_bytes"]),
            kib(r["kv_cache_bytes"]),
            kib(r["window_bytes"]),
            f"{r['max_diff']:.1e}",
        ]
        if args.torch:
            cells += [ms(r["ours_step_ms"]), ms(r["torch_step_ms"])]
        table.append(cells)
    print(
        f"1) {args.tokens} tokens after a {args.prompt}-token prompt: d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads over {args.kv_heads} kv heads, {args.dtype}, vocab {args.vocab}"
    )
    label = lambda r: f"context {r['context']:,}"  # noqa: E731
    print(machine.marked_table(table, rows, headers, args.format, label, width=table_width(args)))
    print("  ms/token: mean over the steps since the previous row; peak: one step under tracemalloc, output included")
    print("  cache KiB: the keys and values attention sees now, all layers (the views' bytes)")
    first, last = rows[0], rows[-1]
    growth = last["context"] / first["context"]
    if first["cached_ms"] and last["cached_ms"] and first["recompute_ms"] and last["recompute_ms"]:
        steps = (
            f"cached step x{last['cached_ms'] / first['cached_ms']:.1f}, "
            f"recompute step x{last['recompute_ms'] / first['recompute_ms']:.1f}"
        )
        print(
            f"  context x{growth:.1f}: {machine.concluded(rows, steps)}, "
            f"cached peak x{last['cached_peak'] / first['cached_peak']:.1f}, "
            f"recompute peak x{last['recompute_peak'] / first['recompute_peak']:.1f}"
        )


# ---------------------------------------------------------------------------------------------------
# arguments, and the whole run estimated before it starts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    tokens, heads = positive(int, MAX_TOKENS), positive(int, limits.MAX_HEADS)
    p.add_argument("--tokens", type=tokens, default=248, help="tokens to generate (default 248)")
    p.add_argument("--prompt", type=tokens, default=8, help="prompt tokens, one prefill (default 8)")
    p.add_argument("--window", type=tokens, default=16, help="sliding window of the window cache (default 16)")
    p.add_argument("--d-model", type=positive(int, 4096), default=64, help="model width C (default 64)")
    p.add_argument("--layers", type=positive(int, 64), default=2, help="attention blocks (default 2)")
    p.add_argument("--vocab", type=positive(int, 1_000_000), default=512, help="vocabulary size (default 512)")
    p.add_argument("--step", action="store_true", help="time one long decode step instead of generating")
    p.add_argument(
        "--context",
        type=positive(int, limits.MAX_TOKENS),
        default=32768,
        help="--step: cached keys S (default 32768)",
    )
    p.add_argument("--heads", type=heads, default=None, help="query heads (default 4; --step: 32)")
    p.add_argument("--kv-heads", type=heads, default=None, help="key/value heads (default 2; --step: 8)")
    p.add_argument("--head-dim", type=heads, default=128, help="--step: channels per head E (default 128)")
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=5,
        help="--step: timed runs per kernel (default 5)",
    )
    add_wide_argument(p)
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="dtype of weights, cache and inputs (default float64; --step: float32)",
    )
    p.add_argument("--torch", action="store_true", help="add torch (CPU): SDPA, and with --step also plain matmuls")
    p.add_argument("--layouts", action="store_true", help="--step: also flash_decode under each block layout")
    p.add_argument("--json", metavar="PATH", help="also write the rows, the machine and the code version to PATH")
    add_seed_and_format(p, "the random model and prompt")
    args = p.parse_args(argv)
    args.heads = args.heads or (32 if args.step else 4)
    args.kv_heads = args.kv_heads or (8 if args.step else 2)
    args.dtype = args.dtype or ("float32" if args.step else "float64")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not args.step:
        if args.d_model % args.heads or (args.d_model // args.heads) % 2:
            p.error(f"--d-model ({args.d_model}) must split into --heads ({args.heads}) heads of an even size (RoPE)")
        if args.prompt + args.tokens > MAX_TOKENS:
            p.error(f"--prompt + --tokens must be at most {MAX_TOKENS:,}: recomputing every step grows as T³")
    needed, detail, lower = run_bytes(args)
    problem = limits.memory_problem(needed, "this run", lower, detail)
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)
    if args.torch:
        torch_import.load_torch()  # now, not after the run
    return args


def run_bytes(args: argparse.Namespace) -> tuple[int, str, str]:
    """(peak bytes, " (what they hold)", which flags to lower) of the whole run, estimated from the flags.

    --step: k and v, and the reference's scores (tinyattn_np.naive_attention_bytes).
    generation: the token table and every layer's weights, both caches at their full size, and the largest
    step: a full recompute at the last context (x, qkv and flash's working memory, per layer) or the
    band-mask reference the window cache is checked against (tinyattn_np.naive_attention_bytes with its mask).
    """
    c = np.dtype(args.dtype).itemsize
    if args.step:  # k, v; paged by 16, by 256, by 16 in twice the blocks; the batch's keys; the scores
        tokens = 5 * args.context + int(
            np.linspace(args.context // 32 or 1, args.context, decode_step.BATCH).astype(int).sum()
        )
        sizes = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, causal=True)
        needed = 2 * args.kv_heads * args.head_dim * c * tokens + naive_attention_bytes(1, args.context, **sizes)
        what = f" (the caches and the scores at S={args.context:,})"
        return needed, what, "lower --context, --kv-heads or --head-dim"
    T, C, d = args.prompt + args.tokens, args.d_model, args.d_model // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * d
    weights = (args.vocab * C + args.layers * (C * qkv + C * C)) * c
    caches = 2 * args.layers * args.kv_heads * d * (T + min(T, args.window)) * c
    sizes = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=d, dtype=args.dtype, causal=True)
    recompute = T * (2 * C + qkv) * c + flash_attention_bytes(T, **sizes)
    band = naive_attention_bytes(T, **sizes, bool_mask=True)
    needed = weights + caches + max(recompute, band) + 2 * args.vocab * c
    return (
        needed,
        " (the model, its caches and one step's arrays)",
        "lower --d-model, --vocab, --layers or --tokens",
    )


def run_flops(args: argparse.Namespace) -> float:
    """FLOPs of the whole run: --step's kernels, or every generated token's three forwards (cached,
    recomputed, windowed) and the band-mask reference at each checkpoint."""
    # six kernels over S keys, with torch two more and the turns, with --layouts six more; the batch
    if args.step:
        kernels = (
            6 + (2 + 2 * decode_step.TURNS) * args.torch + len(DECODE_LAYOUTS) * args.layouts + decode_step.BATCH // 2
        )  # ~B/2 times S
        return kernels * (args.repeats + 2) * attention_flops(1, args.context, heads=args.heads, head_dim=args.head_dim)
    C, d, layers = args.d_model, args.d_model // args.heads, args.layers
    qkv = (args.heads + 2 * args.kv_heads) * d

    def forward(n: int, context: int) -> float:  # n new tokens attending over `context` keys
        attend = attention_flops(n, context, heads=args.heads, head_dim=d, causal=True)
        return layers * (2 * n * C * (qkv + C) + attend) + 2 * C * args.vocab

    total = args.prompt + args.tokens
    contexts = range(args.prompt + 1, total + 1)
    marks = checkpoints(args.prompt, total)
    references = sum(forward(t, t) for t in marks)  # the band-mask reference at each checkpoint
    return sum(forward(1, t) + forward(t, t) + forward(1, min(t, args.window)) for t in contexts) + references


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rate = machine.matmul_rate(args.dtype, n=machine.RATE_SIZE, repeats=3)
    problem = limits.time_problem(run_flops(args), rate, "lower --tokens, --d-model, --layers, --context or --repeats")
    if problem:
        sys.exit(f"decode.py: error: {problem}")
    rng = np.random.default_rng(args.seed)
    info, lines = machine.header()
    print(lines)
    if args.step:
        rows, stopped, total = decode_step.run(args, rng, rate, check)
    else:
        run = SimpleNamespace(rows=[], worst=0.0, same_tokens=True, window_worst=0.0, rate=rate)
        run.torch_step = make_torch_step(args) if args.torch else None
        stopped = interrupts.measure_each([None], lambda _: generate(TinyDecoder(args, rng), args, rng, run), [])
        rows, total = run.rows, len(checkpoints(args.prompt, args.prompt + args.tokens))
        if rows:
            print_generation(rows, args)
            check_generation(run, args)
    if args.json is not None:
        outputs.write_json(
            args.json, {"args": vars(args), "machine": info, "matmul_gflops": rate, "rows": rows}, stopped
        )
    return interrupts.interrupted(len(rows), total) if stopped else check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
