"""tiles.py --profile: where one forward and one backward of flash attention, one decode step (flash_decode's
engine) and one MLA decode step spend their time (tinyattn_np.profiler times a copy of each kernel's loop,
part by part), printed as four tables, each with the kernel's time as a multiple of its products'. And the
table of sparse.py's and linear.py's last section (parts_so_far): a profile's parts, each with the time so far
against the FLOPs at the matmul rate.
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
from tinyattn_np.presets import PRESETS
from tinyattn_np.profiler import PARTS, PYTHON
from tinyattn_np.report import table

MATMULS = PARTS[0]
PRODUCTS_AIM = 1.25  # what lies between the products: at most a quarter of their own time
DEEPSEEK_V3 = PRESETS["deepseek-v3"]  # its latent attention: 128 heads over a latent of 512 + 64 numbers
MLA, MLA_HEADS = DEEPSEEK_V3.latent, DEEPSEEK_V3.heads


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


def profile_decode(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """A decode step's profile: the last token's queries against the T keys and values of every head."""
    rate = lambda: machine.matmul_rate(args.dtype, repeats=1)  # noqa: E731
    q, k, v = qkv
    return profiler.profile_decode(q[:, :, -1:], k, v, repeats=args.repeats, matmul_rate=rate)


def profile_mla(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The MLA decode step's profile: DeepSeek-V3's 128 heads over T latents, random weights (from --seed + 2)."""
    rate = lambda: machine.matmul_rate(args.dtype, repeats=1)  # noqa: E731
    rng, dtype = np.random.default_rng(args.seed + 2), np.dtype(args.dtype)
    q_nope = rng.standard_normal((1, MLA_HEADS, 1, MLA.nope_dim), dtype=dtype)  # (B, H, 1, d_nope)
    q_rope = rng.standard_normal((1, MLA_HEADS, 1, MLA.rope_dim), dtype=dtype)  # (B, H, 1, d_rope)
    latent = rng.standard_normal((1, 1, args.tokens, MLA.kv_rank + MLA.rope_dim), dtype=dtype)  # (B, 1, S, r + d_rope)
    w_ukv = rng.standard_normal((MLA.kv_rank, MLA_HEADS * (MLA.nope_dim + MLA.v_dim)), dtype=dtype) / np.sqrt(
        MLA.kv_rank
    )
    return profiler.profile_mla(q_nope, q_rope, latent, w_ukv, repeats=args.repeats, matmul_rate=rate)


def profile_title(name: str, row: dict[str, Any], args: argparse.Namespace) -> tuple[str, str]:
    """The table's first line, and the unit its parts are counted in."""
    if name == "decode step":
        shape = f"1 query of {args.heads} heads x {args.head_dim} against T={args.tokens:,} keys"
        return f"{shape}, {args.dtype}; blocks of {row['block_k']:,} keys; {row['tiles']:,} blocks", "block"
    if name == "MLA decode step":
        shape = f"{MLA_HEADS} heads over T={args.tokens:,} latents of {MLA.kv_rank} + {MLA.rope_dim}, absorbed"
        return f"{shape}, {args.dtype}; {row['tiles']:,} blocks of keys", "block"
    plan, per_step = row["plan"], getattr(row["plan"], "kv_heads_per_step", None)
    tile = f"{plan.block_q} x {plan.block_k} tiles" + (f", {per_step} kv heads per step" if per_step else "")
    tile += f", heads per item: {row['heads']}" if "heads" in row else ""
    unit, units = ("tile step", "tile steps") if per_step else ("tile of one head", "tiles of one head")
    mask = "causal" if not args.no_causal else "no mask"
    shape = f"T={args.tokens:,}, {args.heads} heads x {args.head_dim}, {args.dtype}, {mask}"
    return f"{shape}; {tile}; {row['tiles']:,} {units}", unit


def print_profile(name: str, row: dict[str, Any], args: argparse.Namespace) -> None:
    """One table: each part per tile and in all, and its share of the copy's run on one thread; then the run
    as a multiple of its products' time (profiler.products_ratio)."""
    tiles, parts, total = row["tiles"], row["parts_ms"], sum(row["parts_ms"].values())
    title, unit = profile_title(name, row, args)
    print(f"\n{name}: {title}\n  on one worker; each part the least of {args.repeats} runs")
    body = [[part, 1e3 * parts[part] / tiles, parts[part], f"{parts[part] / total:.0%}"] for part in (*PARTS, PYTHON)]
    body.append(["in all", 1e3 * total / tiles, total, "100%"])
    print(table(body, ["part", f"µs per {unit}", "ms in all", "share"], fmt=args.format, floatfmt=".1f"))
    gflops, rate = row["flops"] / parts[MATMULS] / 1e6, row["matmul_gflops"]
    print(
        f"matmuls: {gflops:.1f} GFLOP/s, {gflops / rate:.0%} of a 2048² {args.dtype} matmul on one BLAS "
        f"thread beside them ({rate:.1f} GFLOP/s, the best of {args.repeats});\n  the kernel itself: "
        f"{row['kernel_ms']:.1f} ms on one worker{all_workers(row)}; the profile's copy gives the kernel's bits: "
        f"{'yes' if row['same_bits'] else 'NO'}"
    )
    ratio = profiler.products_ratio(row)
    aim = "within" if ratio <= PRODUCTS_AIM else "over"
    print(
        f"in all: {ratio:.2f}x its products (the time between them {ratio - 1:.0%} of theirs; {aim} the aim of "
        f"{PRODUCTS_AIM:.2f}x)"
    )


def parts_so_far(row: dict[str, Any], at_rate: float, fmt: str) -> str:
    """A profile's parts as a table (sparse.py's and linear.py's last section): each part's ms and share, and the
    time so far, this part and those above it, as a multiple of at_rate (ms: the FLOPs at the matmul rate), the
    busy note under it."""
    parts, body, so_far = row["parts_ms"], [], 0.0
    for part, ms in parts.items():
        so_far += ms
        body.append([part, f"{ms:,.1f}", f"{ms / sum(parts.values()):.0%}", f"{so_far / at_rate:.2f}x"])
    marks = [dict(row, part="the parts")] + [{}] * (len(body) - 1)  # measured together: one note for all
    return machine.marked_table(body, marks, ["part", "ms", "share", "so far / FLOPs at the rate"], fmt, busy_label)


def busy_label(row: dict[str, Any]) -> str:
    return str(row["part"])


def runs_said(repeats: int) -> str:
    return "each part from one run" if repeats == 1 else f"each part the least of {repeats} runs"


def floor_verdict(row: dict[str, Any], floor: float, aim: float) -> str:
    """Where the first parts alone (floor, a multiple of the FLOPs at the rate) stand against the aim; none on a
    busy machine."""
    return "not judged (a busy machine):" if row.get("busy") else "above" if floor > aim else "within"


def all_workers(row: dict[str, Any]) -> str:
    """', 12.3 ms on 2' for a kernel profiled on every worker too, else nothing."""
    return f", {row['all_workers_ms']:.1f} ms on {row['plan'].workers}" if "all_workers_ms" in row else ""


def profile_main(args: argparse.Namespace) -> int:
    """--profile: the header, then the forward's, the backward's, the decode step's and the MLA step's tables;
    Ctrl-C keeps the tables printed."""
    benchmark.check_agreement(args, not args.no_causal)
    info, lines = machine.header()
    print(lines)
    qkv, rows = benchmark.make_qkv(np.random.default_rng(args.seed), args.tokens, args), []
    profiles = {
        "forward": profile_forward,
        "backward": profile_backward,
        "decode step": profile_decode,
        "MLA decode step": profile_mla,
    }
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
        return interrupts.interrupted(len(done), len(profiles), "tables")
    return 0 if all(row["same_bits"] for row in done.values()) else 1
