"""decode.py --step: one decode step at a long context beside its floor, the time to read the cache's bytes
once (NumPy sums, one thread and two): flash_decode, paged_decode over blocks of 16 and 256 (and of 16 in
every other block), flash_attention() and attention(); with --torch, SDPA and torch's fastest CPU formulation
(the query heads of each kv head stacked into one matrix); then BATCH sequences of S/32 .. S keys in one
paged_decode step beside their own floor. Every kernel is checked against attention() before it is timed.
"""

from __future__ import annotations

import argparse
from typing import Any

import interrupts
import machine
import numpy as np
import outputs
import torch_import

from tinyattn_np import PagedKVCache, attention, flash_attention, flash_decode, format_bytes, paged_decode
from tinyattn_np.measure import alternating_medians_ms, read_once
from tinyattn_np.report import Checklist, max_diff, table_width
from tinyattn_np.tune import DECODE_LAYOUTS, decode_layout, in_layout

BATCH = 16  # --step: sequences in the batch row, of S/32 .. S keys
FLASH, TORCH_FASTEST = "flash_decode (split-KV)", "torch matmuls, the heads of a kv head stacked"
# --step --torch: flash_decode and torch's fastest also timed in this many turns of --repeats runs each
TURNS = 3
TARGETED = ("flash_decode", "paged_decode, blocks of", f"{BATCH} sequences: paged")  # --step rows with aims


def run(args: argparse.Namespace, rng: np.random.Generator, rate: float, check: Checklist) -> tuple[list, bool, int]:
    """The rows of every kernel, measured until Ctrl-C, and their table:
    (rows, stopped by Ctrl-C, kernels)."""
    runs = step_kernels(args, rng)
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(runs, lambda item: measure_kernel(item, args, rate, runs, check), rows)
    if rows:
        print_step(rows, args)
    return rows, stopped, len(runs)


def step_kernels(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[str, str, Any, Any]]:
    """(name, group, run, its answer) for every row: the floor, the kernels on one q (1, Hq, 1, E), k, v (1, Hkv, S,
    E), and a batch of BATCH sequences of S/32 .. S keys in one paged_decode step beside its own floor ("batch")."""
    dtype, shape = np.dtype(args.dtype), (args.kv_heads, args.context, args.head_dim)
    q = rng.standard_normal((1, args.heads, 1, args.head_dim), dtype=np.float64).astype(dtype)  # (1, Hq, 1, E)
    k, v = (rng.standard_normal(shape, dtype=np.float64).astype(dtype)[None] for _ in range(2))  # (1, Hkv, S, E)
    gold = attention(q, k, v)  # (1, Hq, 1, E): the reference
    runs = [
        ("read K and V once, 1 thread", "one", lambda: read_once([k, v], threads=1), None),
        ("read K and V once, 2 threads", "one", lambda: read_once([k, v], threads=2), None),
        (FLASH, "one", lambda: flash_decode(q, k, v), gold),
    ]
    for layout in DECODE_LAYOUTS if args.layouts else ():
        first = "keys" if layout.keys_first else "queries"
        name = f"flash_decode, blocks of {layout.scores_per_block:,} scores, {first} first"
        runs.append((name, "one", lambda layout=layout: in_layout(layout, flash_decode, q, k, v), gold))
    for size, scattered in ((16, False), (256, False), (16, True)):
        cache, seqs = paged([args.context], k[0], v[0], size, scattered)
        name = f"paged_decode, blocks of {size}" + (", every other block" if scattered else "")
        runs.append((name, "one", lambda c=cache, s=seqs: paged_decode(q, c, s), gold))
    runs += [
        ("flash_attention", "one", lambda: flash_attention(q, k, v, causal=True), gold),
        ("attention (reference)", "one", lambda: attention(q, k, v, causal=True), gold),
    ]
    if args.torch:
        runs += torch_runs(q, k, v, gold, args)
    lengths = np.linspace(args.context // 32 or 1, args.context, BATCH).astype(int).tolist()
    batch, seqs = paged(lengths, k[0], v[0], 16, False)
    q_b = rng.standard_normal((BATCH, args.heads, 1, args.head_dim), dtype=np.float64).astype(dtype)
    gold_b = np.stack([attention(q_b[i], k[0, :, :n], v[0, :, :n]) for i, n in enumerate(lengths)])
    return runs + [
        (
            f"{BATCH} sequences of {lengths[0]:,}..{lengths[-1]:,} keys: read once",
            "batch",
            lambda: read_once([batch.k_pool, batch.v_pool], threads=2),
            None,
        ),
        (
            f"{BATCH} sequences: paged_decode, blocks of 16",
            "batch",
            lambda: paged_decode(q_b, batch, seqs),
            gold_b,
        ),
    ]


def paged(lengths: list[int], k: np.ndarray, v: np.ndarray, size: int, scattered: bool) -> tuple[Any, list[int]]:
    """A PagedKVCache of blocks of `size` holding sequences of these lengths (sequence i: the first n of k, v
    (Hkv, S, E)), written 512 tokens at a time in turn, as chunked prefills interleave; scattered: in every
    other block of the pool (no two blocks adjacent), by filling it with one-block sequences, every other freed."""
    blocks = sum(-(-n // size) for n in lengths)
    cache = PagedKVCache(2 * blocks + 1 if scattered else blocks, size, k.shape[0], k.shape[-1], dtype=k.dtype)
    if scattered:
        singles = [cache.add_sequence() for _ in range(cache.num_blocks)]
        cache.append_batch(singles, *np.zeros((2, len(singles), k.shape[0], 1, k.shape[-1]), k.dtype))
        for seq in (seq for seq in singles if cache.block_table(seq)[0] % 2 == 0):
            cache.free(seq)
    seqs = [cache.add_sequence() for _ in lengths]
    for start in range(0, max(lengths), 512):
        for seq, n in zip(seqs, lengths, strict=True):
            if start < n:
                cache.append(seq, k[:, start : min(start + 512, n)], v[:, start : min(start + 512, n)])
    return cache, seqs


def torch_runs(q: np.ndarray, k: np.ndarray, v: np.ndarray, gold: np.ndarray, args: argparse.Namespace) -> list:
    """torch SDPA (enable_gqa: a slow path on CPU) and torch's fastest formulation of the same step that we
    know on CPU: plain matmuls with the G query heads of each kv head stacked into one (G, E) matrix."""
    torch, F = torch_import.load_torch()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    stacked = tq.reshape(args.kv_heads, -1, args.head_dim) / args.head_dim**0.5  # (Hkv, G, E), the scale folded in
    weights = lambda: torch.softmax(stacked @ tk[0].transpose(-1, -2), dim=-1)  # noqa: E731  (Hkv, G, S)
    matmuls = lambda: (weights() @ tv[0]).reshape(q.shape)  # noqa: E731  (Hkv, G, E) -> (1, Hq, 1, E)
    sdpa = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
    return [("torch SDPA (enable_gqa)", "one", sdpa, gold), (TORCH_FASTEST, "one", matmuls, gold)]


def measure_kernel(
    item: tuple[str, str, Any, Any], args: argparse.Namespace, rate: float, runs: list, check: Checklist
) -> dict:
    """One row: the kernel checked and timed; torch's fastest also in turns with flash_decode
    (a drift slows both)."""
    name, group, kernel, gold = item
    outputs.progress(f"  {name}")
    out = kernel()
    diff = None if gold is None else max_diff(out.numpy() if hasattr(out, "numpy") else out, gold)
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    if diff is not None:  # a kernel (a read of the bytes, the floor, gives no answer to check)
        check(diff <= tol, f"{name} equals attention() (max |diff| {diff:.1e})")
    beside = machine.beside_the_row(args.dtype, rate, n=machine.RATE_SIZE)
    # after an idle: BLAS's threads spin after the rate's matmul
    ms = machine.settled_median_ms(kernel, args.repeats)
    row = {"kernel": name, "group": group, "ms": ms, "max_diff": diff, **beside}
    if name == TORCH_FASTEST:
        flash = next(run for row_name, _, run, _ in runs if row_name == FLASH)
        row["in_turns"] = alternating_medians_ms([flash, kernel], args.repeats, TURNS, idle=machine.SETTLE_SECONDS)
    return row


def print_step(rows: list[dict], args: argparse.Namespace) -> None:
    # a group's floor: the fastest of its reads of its bytes
    reads = [r for r in rows if r["max_diff"] is None]
    floor = {r["group"]: min(x["ms"] for x in reads if x["group"] == r["group"]) for r in reads}
    ms = {r["kernel"]: r["ms"] for r in rows}
    ours, fastest = ms.get(FLASH, np.nan), ms.get(TORCH_FASTEST)
    turns = next((r["in_turns"] for r in rows if "in_turns" in r), None)  # (flash_decode's ms, torch's fastest's)
    body = [
        [
            r["kernel"],
            f"{r['ms']:.2f}",
            f"{r['ms'] / floor.get(r['group'], np.nan):.2f}x",
            f"{r['ms'] / ours:.2f}x",
        ]
        + ([f"{r['ms'] / fastest:.2f}x"] if fastest else [])
        + ["-" if r["max_diff"] is None else f"{r['max_diff']:.1e}"]
        for r in rows
    ]
    headers = ["one decode step", "ms (median)", "/ floor", "/ flash_decode"] + (["/ torch fastest"] if fastest else [])
    kv = format_bytes(2 * args.kv_heads * args.context * args.head_dim * np.dtype(args.dtype).itemsize)
    print(
        f"2) one decode step: L = 1 query, S = {args.context:,} cached keys, {args.heads} query heads over "
        f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype};\n   the cache read is {kv}"
    )
    headers += ["max |diff| vs attention()"]
    print(machine.marked_table(body, rows, headers, args.format, lambda r: r["kernel"], width=table_width(args)))
    print("  floor: the faster of the two reads of the same bytes (for the batch, its own bytes), in this run")
    print(f"  flash_decode's layout in force: {decode_layout()}")
    if turns:
        print(
            f"  {FLASH} and torch's fastest in turns ({TURNS} turns of {args.repeats} runs each): {turns[0]:.2f} "
            f"and {turns[1]:.2f} ms, {turns[0] / turns[1]:.2f}x"
        )
    if any(r.get("busy") for r in rows):  # the aims are judged on a quiet machine only
        print(f"  the decoding kernels' aims: {machine.NO_CONCLUSION}")
        return
    for r in (r for r in rows if r["kernel"].startswith(TARGETED)):  # the decoding kernels' aims, in this run
        goals = {"the floor": (r["ms"] / floor.get(r["group"], np.nan), 1.3)}
        if fastest and r["group"] == "one":  # flash_decode's from its time in turns with torch's
            x = turns[0] / turns[1] if turns and r["kernel"] == FLASH else r["ms"] / fastest
            goals["torch's fastest"] = (x, 1.0)
        said = [
            f"{x:.2f}x {what} (target {t}x: {'met' if x <= t else f'{x / t - 1:.0%} over'})"
            for what, (x, t) in goals.items()
        ]
        print(f"  {r['kernel']}: {'; '.join(said)}")
