"""Attention patterns as mods, measured: our flex_attention beside flash_attention, our dense-mask reference,
torch SDPA with a dense mask and torch's compiled flex_attention, on the same cores.

    python scripts/flex.py                                # T = 1024, 4 heads of 64, float32: seconds
    python scripts/flex.py --tokens 16384 --torch         # docs/flex.md's table (minutes: the dense paths)
    python scripts/flex.py --tokens 16384 --baseline DIR  # "today's" flash from DIR/tinyattn_np (another version)
    python scripts/flex.py --no-reference                 # our paths only
    python scripts/flex.py --varlen --tokens 8192         # packed documents against the same as a batch, only

The patterns, all over T tokens (self-attention, L = S = T): causal; 8 packed documents, each causal;
prefix-LM (the first T/4 tokens bidirectional); a sliding window (1024 keys, or T/4 if less); ALiBi and
softcap (50) on causal.
For each: the tile map (T/16 a cell), the tiles that run, the time of the block mask, of our flex_attention
and of the others, peaks, and the ratios the targets speak of (judged at T = 16,384 only, shown elsewhere):
    causal as a mask_mod          flex / flash_attention(causal=True) (the baseline's, with --baseline)
    ALiBi, softcap                flex / that causal flash
    8 documents                   flex / the 8 documents as a batch of 8 x T/8, and flex / causal flash
    every pattern (--torch)       flex / torch's compiled flex_attention
--varlen times only packed documents: flash_attention_varlen (causal) on 8 and on 32 documents of T / 8 tokens
each, against flash_attention on the same documents as a batch, round-robin; the target: at most 1.3x. Times:
medians of --repeats calls after a warm-up, all a target compares timed round-robin with an n x n matmul among
them (n³ near one causal call's work), so that a busy spell falls on all alike; the dense paths run once each
afterwards, each row marked '*' (with a note) where the matmul rate just before moved over 20% or the load
exceeded the cores. An idle only where the previous call's library (BLAS, torch) leaves its threads spinning.
Peaks: tracemalloc for NumPy, the growth of the resident set (VmHWM) for torch, which tracemalloc cannot see.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import tinyattn_np as ta
from tinyattn_np import format_bytes
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q
from tinyattn_np.measure import median_ms, traced_peak
from tinyattn_np.report import (
    add_format_argument,
    add_wide_argument,
    nonnegative_seed,
    positive,
    table_width,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import flex_patterns
import flex_torch
import interrupts
import limits
import machine
import outputs

# the T the targets are set for (docs/flex.md's table); other sizes show the ratios only
TARGET_TOKENS = 16384
TARGETS = {
    "causal": 1.1,
    "alibi": 1.5,
    "softcap": 1.5,
    "documents vs batch": 1.3,
    "documents vs causal": 0.2,
    "torch flex": 1.5,
    "packed vs batch": 1.3,
}
VARLEN_DOCUMENTS = (8, 32)  # --varlen: packed documents of T / 8 tokens each
MAX_SIZES = {
    "tokens": 2**17,
    "heads": limits.MAX_HEADS,
    "head_dim": 1024,
    "documents": 2**13,  # each flag's largest:
    "repeats": limits.MAX_REPEATS,
    "workers": limits.MAX_WORKERS,
}  # past it, no run fits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cap = {name: positive(int, most) for name, most in MAX_SIZES.items()}
    p.add_argument(
        "--tokens",
        type=cap["tokens"],
        default=1024,
        help=f"T, a multiple of 16 (default 1024; the targets': {TARGET_TOKENS})",
    )
    p.add_argument("--heads", type=cap["heads"], default=4, help="query heads = kv heads (default 4)")
    p.add_argument("--head-dim", type=cap["head_dim"], default=64, help="E (default 64)")
    p.add_argument("--window", type=cap["tokens"], help="the sliding window's keys (default 1024, or T/4 if less)")
    p.add_argument("--documents", type=cap["documents"], default=8, help="packed, T / n tokens each (default 8)")
    p.add_argument("--repeats", type=cap["repeats"], default=3, help="timed calls of each of our paths (default 3)")
    p.add_argument("--workers", type=cap["workers"], help="our threads, and torch's (default: the CPU count)")
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="time flash_attention(causal=True) from DIR/tinyattn_np too, "
        "e.g. made by: git archive 8c57371 tinyattn_np | tar -x -C DIR",
    )
    p.add_argument("--no-reference", action="store_true", help="leave out our dense-mask reference (L x S memory)")
    p.add_argument("--torch", action="store_true", help="add torch SDPA and torch's compiled flex (needs torch)")
    p.add_argument(
        "--varlen",
        action="store_true",
        help="time only packed documents (flash_attention_varlen) against "
        f"the same as a batch: {' and '.join(map(str, VARLEN_DOCUMENTS))} of T / 8 tokens each",
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure, the machine and the code to PATH")
    add_format_argument(p)
    add_wide_argument(p)
    p.add_argument("--seed", type=nonnegative_seed, default=0, help="seed for q, k, v (an int >= 0; default 0)")
    args = p.parse_args(argv)
    if args.tokens % math.lcm(16, args.documents):
        p.error(f"--tokens must be a multiple of 16 and of --documents; got {args.tokens}")
    # q, k, v and their packed or batched copies
    inputs = 3 * 2 * args.heads * args.tokens * args.head_dim * 4
    if problem := limits.memory_problem(
        inputs,
        f"T={args.tokens:,} with {args.heads} heads x {args.head_dim}",
        "lower --tokens, --heads or --head-dim",
        " for q, k, v alone",
    ):
        p.error(problem)
    args.window = args.window or min(1024, args.tokens // 4)  # a window of T or more would be causal
    outputs.check_output(p, "--json", args.json)
    if args.baseline and not (Path(args.baseline) / "tinyattn_np" / "__init__.py").is_file():
        p.error(f"--baseline {args.baseline}: no tinyattn_np/__init__.py there")
    return args


# ---------------------------------------------------------------------------------------------------
# measuring


def round_robin(calls: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds (median) of each call, timed one call of each in turn, after one warm-up call of each; a short
    idle before a call that follows another library's whose threads spin after a call (BLAS's in the probe
    matmul, torch's OpenMP), so that they do not slow it down; none after our own workers, which do not spin."""
    spins = {name: "torch" if name.startswith("torch ") else "BLAS" if name == "matmul" else "" for name in calls}
    times: dict[str, list[float]] = {name: [] for name in calls}
    previous = ""
    for repeat in range(repeats + 1):
        for name, call in calls.items():
            if spins.get(previous) and spins[previous] != spins[name]:
                time.sleep(machine.SETTLE_SECONDS)
            started = time.perf_counter()
            call()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - started)
            previous = name
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def probe_matrix(args: argparse.Namespace) -> np.ndarray:
    """The n x n float32 matrix whose square says how fast the machine is now: n³ near one causal flex call's
    H·T²·E multiply-adds, n a power of 2 from 256 to 2048 (a short run probes with a short matmul)."""
    work = args.heads * args.tokens**2 * args.head_dim
    n = int(min(2048, max(256, 2 ** round(math.log2(work) / 3))))
    return np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)  # (n, n)


def probe_rate(square: np.ndarray) -> float:
    """GFLOP/s of square @ square (median of 3 calls after one warm-up), on all BLAS threads."""
    return 2 * square.shape[0] ** 3 / median_ms(lambda: square @ square, 3) / 1e6


# ---------------------------------------------------------------------------------------------------
# the rows


def timed_rows(
    args: argparse.Namespace, qkv: tuple[np.ndarray, ...], baseline: Any, side: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """Block masks, tile counts, peaks and round-robin times of our paths, with the flash baselines and (side:
    torch) torch's compiled flex_attention in the same rounds, so that the ratios see the same machine."""
    q, k, v = qkv
    T, n = args.tokens, args.tokens // args.documents
    rows, calls = {}, {}
    for name, (mask_mod, score_mod) in flex_patterns.patterns(args).items():
        started = time.perf_counter()
        block_mask = ta.create_block_mask(mask_mod, None, None, T, T)
        mask_s = time.perf_counter() - started
        run = dict(score_mod=score_mod, block_mask=block_mask, workers=args.workers)
        _, peak = traced_peak(ta.flex_attention, q, k, v, **run)
        calls[name] = lambda run=run: ta.flex_attention(q, k, v, **run)
        rows[name] = {
            "pattern": name,
            "mask": block_mask,
            "mask s": mask_s,
            "flex peak": peak,
            "tiles": int(block_mask.to_dense().sum()),
            "of": block_mask.kinds[0, 0].size,
        }
        if side is not None:  # compiled at its warm-up call
            calls["torch " + name] = flex_torch.torch_flex_call(name, args, side)
    flash = baseline.flash_attention if baseline is not None else ta.flash_attention
    calls["flash causal"] = lambda: flash(q, k, v, causal=True, workers=args.workers)
    batch = [x.reshape(args.heads, args.documents, n, args.head_dim).swapaxes(0, 1) for x in qkv]  # (docs, H, n, E)
    calls["documents as a batch"] = lambda: ta.flash_attention(*batch, causal=True, workers=args.workers)
    square = probe_matrix(args)
    calls["matmul"] = lambda: square @ square  # the machine's speed while these ran, in the same rounds
    outputs.progress(
        f"timing {len(calls) - 1} paths and a matmul round-robin, {args.repeats} calls each (torch's "
        "flex_attention compiles at its first call)"
    )
    times = round_robin(calls, args.repeats)
    for name, row in rows.items():
        row["flex s"], row["torch flex s"] = times[name], times.get("torch " + name)
    rate = 2 * square.shape[0] ** 3 / times["matmul"] / 1e9
    return {
        **rows,
        "_flash": {"s": times["flash causal"]},
        "_batch": {"s": times["documents as a batch"]},
        "_rate": {"GFLOP/s": rate, "load": machine.load_average() or 0.0},
    }


def reference_row(row: dict[str, Any], args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> None:
    """Our dense-mask reference: attention() with the dense bool mask (made beforehand, not timed)."""
    mask_mod, score_mod = flex_patterns.patterns(args)[row["pattern"]]
    dense = ta.create_mask(mask_mod, None, None, args.tokens, args.tokens)[0, 0]  # (T, T) bool
    try:
        _, row["ref peak"] = traced_peak(ta.attention, *qkv, mask=dense, score_mod=score_mod)
        reference = lambda: ta.attention(*qkv, mask=dense, score_mod=score_mod)  # noqa: E731
        row["ref s"] = median_ms(reference, 1) / 1e3  # one warm-up, one timed; BLAS's threads, as the probe's
    except ta.AttentionMemoryError as err:
        row["ref s"] = f"refused: {str(err).split(' at its peak')[0].split('allocate ')[-1]}"


# ---------------------------------------------------------------------------------------------------
# printing


def cell(x: Any, unit: str = "s") -> str:
    return "-" if x is None else x if isinstance(x, str) else format_bytes(x) if unit == "B" else f"{x:.3f}"


def ratio_text(value: float, target: float, judged: bool = True) -> str:
    """'0.59x (<= 1.5: met)' where the target is judged (at its size), else the ratio alone."""
    return f"{value:.2f}x" + (f" (<= {target}: {'met' if value <= target else 'MISSED'})" if judged else "")


def target_text(
    name: str, row: dict[str, Any], rows: dict[str, dict[str, Any]], args: argparse.Namespace, judged: bool
) -> str:
    flash, batch = rows["_flash"]["s"], rows["_batch"]["s"]
    if name == "causal":
        return "flex/flash " + ratio_text(row["flex s"] / flash, TARGETS["causal"], judged)
    if name in ("alibi", "softcap"):
        return "flex/causal flash " + ratio_text(row["flex s"] / flash, TARGETS[name], judged)
    if name == f"{args.documents} documents":
        vs_batch, vs_flash = row["flex s"] / batch, row["flex s"] / flash
        return (
            f"flex/batch {ratio_text(vs_batch, TARGETS['documents vs batch'], judged)}; "
            f"flex/causal flash {ratio_text(vs_flash, TARGETS['documents vs causal'], judged)}"
        )
    return ""


def print_table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The table (rows Ctrl-C cut short show '-' where they have no figure), its busy marks, the targets."""
    headers = ["pattern", "tiles run", "mask s", "flex s", "flex peak", "ref s", "ref peak", "SDPA s", "SDPA peak"]
    headers += ["torch flex s", "torch RSS peak", "flex/torch flex", "GFLOP/s"]
    measured = [row for name, row in rows.items() if not name.startswith("_")]
    busy = any(row.get("busy") for row in measured)
    judged = args.tokens == TARGET_TOKENS and not busy  # a target is judged at its size, on a quiet machine
    body = [table_cells(row, judged) for row in measured]
    # the torch columns with --torch
    keep = range(len(headers)) if args.torch else [*range(7), len(headers) - 1]
    headers, body = [headers[i] for i in keep], [[line[i] for i in keep] for line in body]
    print(
        machine.marked_table(
            body, measured, headers, args.format, label=lambda row: row["pattern"], width=table_width(args)
        )
    )
    ours = rows["_rate"]
    n = probe_matrix(args).shape[0]
    print(
        f"GFLOP/s: a {n} x {n} float32 matmul just before each row's reference and SDPA runs;\n"
        f"in the round-robin timings it ran at {ours['GFLOP/s']:.0f} (load {ours['load']:.1f})\n"
    )
    if args.tokens != TARGET_TOKENS:
        print(f"the targets are set for T = {TARGET_TOKENS:,}: at T = {args.tokens:,} the ratios are shown, not judged")
    elif busy:
        print(f"the targets: {machine.NO_CONCLUSION}; the ratios are shown, not judged")
    for name, row in rows.items():
        if not name.startswith("_") and (text := target_text(name, row, rows, args, judged)):
            print(f"{name}: {text}")
    which = "the baseline's" if args.baseline else "this version's"
    print(
        f"flash_attention(causal=True), {which}: {rows['_flash']['s']:.3f} s; the {args.documents} documents as "
        f"a batch of {args.documents} x {args.tokens // args.documents}: {rows['_batch']['s']:.3f} s"
    )


def table_cells(row: dict[str, Any], judged: bool) -> list[str]:
    """One pattern's row: its tiles, the times and peaks of each path
    ('-' where not measured), torch's ratio."""
    torch_ratio = row["flex s"] / row["torch flex s"] if row.get("torch flex s") else None
    figures = [(row["mask s"], "s"), (row["flex s"], "s"), (row["flex peak"], "B"), (row.get("ref s"), "s")]
    figures += [(row.get("ref peak"), "B"), (row.get("sdpa s"), "s"), (row.get("sdpa peak"), "B")]
    figures += [(row.get("torch flex s"), "s"), (row.get("torch flex peak"), "B")]
    return [
        row["pattern"],
        f"{row['tiles']}/{row['of']}",
        *(cell(x, unit) for x, unit in figures),
        "-" if torch_ratio is None else ratio_text(torch_ratio, TARGETS["torch flex"], judged),
        f"{row['rate']:.0f}" if "rate" in row else "-",
    ]


def print_maps(args: argparse.Namespace) -> None:
    """Each pattern's tile map, drawn with cells of T/16
    (the kernels run tiles of 256: counts in the table)."""
    T = args.tokens
    print(f"tile maps, one cell = {T // 16} x {T // 16} scores ('#' full, '\\' partial, '.' empty):")
    maps = []
    for name, (mask_mod, _) in flex_patterns.patterns(args).items():
        coarse = ta.create_block_mask(mask_mod, None, None, T, T, BLOCK_SIZE=T // 16)
        maps.append([name] + ta.draw_tile_plan(coarse).splitlines())
    for first in range(0, len(maps), 3):  # three maps side by side: 99 columns
        for line in zip(*maps[first : first + 3], strict=True):
            print("   ".join(f"{part:<31}" for part in line).rstrip())
        print()


def varlen_row(args: argparse.Namespace, documents: int) -> dict[str, Any]:
    """Packed documents against the same documents as a batch: one causal flash_attention_varlen call on
    (H, n · T/8, E) and one flash_attention call on (n, H, T/8, E), round-robin; the two checked equal first."""
    tokens, rng = args.tokens // 8, np.random.default_rng([args.seed, documents])
    packed = [rng.standard_normal((args.heads, documents * tokens, args.head_dim), dtype=np.float32) for _ in "qkv"]
    batch = [x.reshape(args.heads, documents, tokens, args.head_dim).swapaxes(0, 1) for x in packed]
    cu = np.arange(documents + 1) * tokens  # documents of T / 8 tokens each
    calls = {
        "packed": lambda: ta.flash_attention_varlen(*packed, cu, cu, causal=True, workers=args.workers),
        "batch": lambda: ta.flash_attention(*batch, causal=True, workers=args.workers),
    }
    packed_out = calls["packed"]().reshape(args.heads, documents, tokens, -1).swapaxes(0, 1)  # (n, H, T/8, E)
    diff = float(np.max(np.abs(packed_out - calls["batch"]())))
    if not diff <= 1e-5:
        sys.exit(f"error: packed documents and the batch disagree at {documents} documents: max |diff| {diff:.3g}")
    outputs.progress(f"timing {documents} packed documents and the batch, {args.repeats} calls each")
    times = round_robin(calls, args.repeats)
    return {"documents": documents, "tokens": tokens, **times, "busy": machine.busy_reasons()}


def print_varlen(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The --varlen table; the target is judged where each document fills a tile at least (T / 8 >= 256):
    shorter documents share tiles when packed, and the batch runs smaller ones."""
    body = []
    for row in rows:
        ratio, judged = row["packed"] / row["batch"], row["tokens"] >= DEFAULT_BLOCK_Q and not row.get("busy")
        text = ratio_text(ratio, TARGETS["packed vs batch"]) if judged else f"{ratio:.2f}x (not judged)"
        body.append([str(row["documents"]), str(row["tokens"]), cell(row["packed"]), cell(row["batch"]), text])
    headers = ["documents", "tokens each", "packed s", "batch s", "packed/batch"]
    label = lambda row: f"{row['documents']} documents"  # noqa: E731
    print(machine.marked_table(body, rows, headers, args.format, label))  # a busy row is marked, not judged
    if any(row["tokens"] < DEFAULT_BLOCK_Q for row in rows):
        print(
            f"documents shorter than a tile ({DEFAULT_BLOCK_Q} tokens) share tiles when packed: the target "
            f"(<= {TARGETS['packed vs batch']}x) is judged from --tokens {8 * DEFAULT_BLOCK_Q} on"
        )


def run_flops(args: argparse.Namespace) -> float:
    """A lower bound on the run's FLOPs: 2·H·T²·E per causal call (half the scores) of four patterns and flash,
    --repeats + 2 calls each; the reference 4·H·T²·E twice per pattern; --varlen: the documents' causal calls."""
    H, T, E = args.heads, args.tokens, args.head_dim
    if args.varlen:
        return sum((args.repeats + 2) * 2 * n * 2 * H * (T // 8) ** 2 * E for n in VARLEN_DOCUMENTS)
    reference = 0 if args.no_reference else len(flex_patterns.patterns(args)) * 2 * 4 * H * T * T * E
    return (args.repeats + 2) * 5 * 2 * H * T * T * E + reference


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := limits.time_problem(run_flops(args), probe_rate(probe_matrix(args)), "lower --tokens or --repeats"):
        sys.exit(f"flex.py: error: {problem}")
    if args.varlen:
        print(
            f"packed documents, causal: {args.heads} heads of {args.head_dim}, float32; workers "
            f"{args.workers or os.cpu_count()}\n" + machine.header(None, None)[1]
        )
        rows: list[dict[str, Any]] = []  # the rows measured, all of them kept on Ctrl-C
        stopped = interrupts.measure_each(VARLEN_DOCUMENTS, lambda documents: varlen_row(args, documents), rows)
        print_varlen(rows, args)
        if args.json:
            outputs.write_json(args.json, {"args": vars(args), "varlen": rows}, stopped)
        return interrupts.interrupted(len(rows), len(VARLEN_DOCUMENTS), "document counts") if stopped else 0
    baseline = flex_patterns.load_baseline(args.baseline) if args.baseline else None
    T, H, E = args.tokens, args.heads, args.head_dim
    rng = np.random.default_rng(args.seed)
    qkv = tuple(rng.standard_normal((1, H, T, E), dtype=np.float32) for _ in range(3))
    side = flex_torch.torch_setup(args, qkv) if args.torch else None
    _, lines = machine.header(side["torch"].__version__ if side else None, args.workers or os.cpu_count())
    print(
        f"T = {T}, {H} heads of {E}, float32, B = 1; workers {args.workers or os.cpu_count()}"
        + (f"; baseline {args.baseline}" if baseline else "")
        + "\n"
        + lines
    )
    if args.window >= T:
        print(f"window {args.window} >= T = {T}: every earlier key is in it, so its row is causal's")
    print(flex_patterns.check_agreement(args, baseline))
    print_maps(args)
    rows = timed_rows(args, qkv, baseline, side)
    stopped = dense_rows(rows, args, qkv, side)
    print_table(rows, args)
    if args.json:
        figures = {name: {key: value for key, value in row.items() if key != "mask"} for name, row in rows.items()}
        outputs.write_json(args.json, {"args": vars(args), "rows": figures}, stopped)
    patterns_done = sum("dense done" in row for row in rows.values())
    return (
        interrupts.interrupted(patterns_done, len(flex_patterns.patterns(args)), "patterns' dense rows")
        if stopped
        else 0
    )


def dense_rows(
    rows: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    qkv: tuple[np.ndarray, ...],
    side: dict[str, Any] | None,
) -> bool:
    """Our dense-mask reference and torch SDPA for each pattern, each row beside the matmul rate measured just
    before it; True when Ctrl-C stopped them (the rows measured so far stay)."""
    first_rate, square = rows["_rate"]["GFLOP/s"], probe_matrix(args)
    try:
        for name, row in rows.items():
            if name.startswith("_"):
                continue
            # torch's threads spun in the row before
            time.sleep(machine.SETTLE_SECONDS if side is not None else 0)
            rate = probe_rate(square)  # the machine's speed just before this row's others
            row["rate"], row["busy"] = rate, machine.busy_reasons(rate, first_rate)
            if not args.no_reference:
                outputs.progress(f"our dense-mask reference: {name}")
                reference_row(row, args, qkv)
            if side is not None:
                flex_torch.torch_row(row, args, side)
            row["dense done"] = True
    except KeyboardInterrupt:
        return True
    return False


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
