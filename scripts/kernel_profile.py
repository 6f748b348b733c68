"""tiles.py --profile: where one forward and one backward of flash attention spend their time. A copy of
flash_forward's and the backward's tile loops runs on one thread, on the tiles the kernels choose, with every
NumPy call timed into its part: the matmuls, the exponentials, the reductions and rescaling, the masking, the
copies and set-up. The copy calls the kernels' own helpers and must give the kernels' bits (checked). "Python
between them" is the rest of the copy's run (the loop, the slicing, the calls), less the timing's own cost.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import benchmark
import interrupts
import machine
import numpy as np
import outputs
from threadpoolctl import threadpool_limits

from tinyattn_np import flash_attention
from tinyattn_np._backward_kernel import (
    check_weights_sum_to_one,
    flex_backward,
    heads_per_item,
    item_heads,
    ones_row_below,
    query_rows,
)
from tinyattn_np._flash_kernel import (
    TileMods,
    apply_mods,
    diagonal_of,
    finish_rows,
    flash_forward,
    forward_items,
    forward_results,
    grouped_heads,
    item_parts,
    kv_rows,
    running_start,
    scaled_queries,
    tile_mods,
    trusted,
)
from tinyattn_np._tiles import Heads
from tinyattn_np.backward import check_flash_backward
from tinyattn_np.flash import check_flash
from tinyattn_np.measure import time_calls
from tinyattn_np.report import table

MATMULS, EXPONENTIALS, REDUCTIONS = "matmuls", "exponentials", "reductions and rescaling"
MASKING, COPIES, PYTHON = "masking", "copies and set-up", "Python between them"
PARTS = (MATMULS, EXPONENTIALS, REDUCTIONS, MASKING, COPIES)


class Stopwatch:
    """Wall time by part: `with clock("matmuls"): ...` adds the time the block took to
    clock.seconds["matmuls"] and counts one lap. Each lap costs a little time outside the block it times:
    lap_cost() measures it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.laps, self.part, self.start = 0, "", 0.0

    def __call__(self, part: str) -> Stopwatch:
        self.part = part
        return self

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self.part] = self.seconds.get(self.part, 0.0) + time.perf_counter() - self.start
        self.laps += 1

    @staticmethod
    def lap_cost(laps: int = 2000) -> float:
        """Seconds one lap adds to a run beyond what it records:
        a run of `laps` empty blocks, less their parts."""
        clock, start = Stopwatch(), time.perf_counter()
        for _ in range(laps):
            with clock("nothing"):
                pass
        return max(time.perf_counter() - start - clock.seconds["nothing"], 0.0) / laps


def best_ms(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` calls of fn() in ms, after one untimed call:
    the least slowed by other work."""
    return 1e3 * min(time_calls(fn, repeats, warmup=1))


def forward_copy(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: Any, plan: Any, clock: Any) -> tuple[Any, Any]:
    """flash_forward on one thread, its items in its order, with the set-up timed (clock) and each item's
    tiles run by block_copy: its out and lse (the kernel's bits)."""
    ct = np.result_type(q, k, v, np.float32)  # the kernel's compute dtype: float32, or float64 where an input is
    with clock(COPIES):
        arrays = grouped_heads(q, k, v, dims, ct)
    for item in forward_items(dims, plan, len(arrays.q), len(arrays.k)):
        heads, rows, query_heads = item_parts(item, arrays, plan, dims.hq)
        with clock(COPIES):
            q_t = scaled_queries(arrays.q, heads, rows, plan.scale, ct)  # (c, E, G·bq)
        block_copy(
            q_t,
            *(x[kv_rows(heads, arrays)] for x in (arrays.k, arrays.v)),
            plan,
            query_heads,
            rows,
            arrays.out[heads, :, rows],
            arrays.lse[heads, :, rows],
            clock,
        )
    with clock(COPIES):
        return forward_results(arrays, dims, ct)


def block_copy(
    q_t: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    plan: Any,
    heads: Heads,
    rows: slice,
    out_rows: np.ndarray,
    lse_rows: np.ndarray,
    clock: Any,
) -> None:
    """flash.attend_block's statements in its order, each timed into its part (tile_scores split in two: its
    matmul and its mods). The fallback it never needs on these inputs is left out: the bits would tell."""
    c, _, n = q_t.shape
    with clock(COPIES):
        mods, q_idx = tile_mods(plan, heads, rows, c)
        m, l = (x.reshape(c, n) for x in running_start(plan.sinks, heads.h, rows.stop - rows.start, q_t.dtype))
        l *= np.exp(m)
        acc, written = np.empty((c, n, v.shape[-1]), q_t.dtype), False
        tile_buf = np.empty(c * min(plan.block_k, k.shape[1]) * n, q_t.dtype)
        ones = np.ones(min(plan.block_k, k.shape[1]), q_t.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in plan.tile_mask.row_tiles(rows.start, rows.stop, k.shape[1], plan.block_k, heads):
            bk = t.k_stop - t.k_start
            s = tile_buf[: c * bk * n].reshape(c, bk, n)
            with clock(MATMULS):
                np.matmul(k[:, t.k_start : t.k_stop], q_t, out=s)
            with clock(MASKING):
                kv_idx = np.arange(t.k_start, t.k_stop).reshape(1, bk, 1, 1)
                apply_mods(s.reshape(c, bk, -1, q_idx.shape[-1]), t, mods, q_idx, kv_idx, keys_down=True)
            with clock(EXPONENTIALS):
                np.exp(s, out=s)
            with clock(REDUCTIONS):
                l += ones[:bk] @ s
            with clock(MATMULS):
                pv = np.matmul(s.transpose(0, 2, 1), v[:, t.k_start : t.k_stop], out=None if written else acc)
            with clock(REDUCTIONS):
                if written:
                    acc += pv
                written = True
    with clock(REDUCTIONS):
        trusted(l, acc)
        finish_rows(acc, np.zeros_like(l), l, out_rows, lse_rows)


def backward_copy(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    dims: Any,
    plan: Any,
    clock: Any,
) -> tuple[Any, ...]:
    """_flex_backward on one thread, every key block of every head in the kernel's order, with the set-up and
    the ending timed (clock) and each key block's tiles run by key_block_copy: dq, dk, dv (the kernel's bits)."""
    ct = np.result_type(q, k, v, out, dout, np.float32)  # float32, or float64 where an input is
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq
    with clock(COPIES):
        k_c, v_c = (np.ascontiguousarray(x.reshape(n_heads // dims.group, dims.n_k, -1), dtype=ct) for x in (k, v))
        q_lse, do_d, d, lse_c = query_rows(q, out, dout, lse, dims, plan.scale, ct)
        dq, p_sums = np.zeros((n_heads, dims.n_q, dims.e), ct), np.zeros((n_heads, dims.n_q), ct)
        dk_heads, dv_heads = (
            np.zeros((n_heads, dims.n_k, dims.e), ct),
            np.zeros((n_heads, dims.n_k, dims.ev), ct),
        )
    c = heads_per_item(plan, n_heads, dims.n_q, dims.n_k)  # the heads of one item, as the kernel takes them
    for k_start in range(0, dims.n_k, plan.block_k):
        for g in range(n_heads // c):
            cols, its = (
                slice(k_start, min(k_start + plan.block_k, dims.n_k)),
                item_heads(g, c, dims.hq, dims.group),
            )
            tiles = list(plan.tile_mask.column_tiles(cols.start, cols.stop, dims.n_q, plan.block_q, its.heads))
            if not tiles:  # a key block no query sees
                continue
            with clock(COPIES):
                k_j, v_j, hs = k_c[its.kv, cols], v_c[its.kv, cols], its.rows
            mods = TileMods(plan.tile_mask.mask_mod, None, its.b, its.h, diagonal_of(plan.tile_mask))
            key_block_copy(
                q_lse[hs],
                k_j,
                v_j,
                do_d[hs],
                mods,
                tiles,
                (dq[hs], p_sums[hs]),
                dk_heads[hs, cols],
                dv_heads[hs, cols],
                clock,
            )
    with clock(REDUCTIONS):
        check_weights_sum_to_one(p_sums, lse_c)
        dq *= plan.scale
        dk = dk_heads.reshape(-1, dims.group, dims.n_k, dims.e).sum(axis=1)
        dv = dv_heads.reshape(-1, dims.group, dims.n_k, dims.ev).sum(axis=1)
    with clock(COPIES):
        return tuple(x.reshape(y.shape).astype(y.dtype, copy=False) for x, y in ((dq, q), (dk, k), (dv, v)))


def key_block_copy(
    q_lse: np.ndarray,
    k_j: np.ndarray,
    v_j: np.ndarray,
    do_d: np.ndarray,
    mods: TileMods,
    tiles: Any,
    dq_rows: tuple[np.ndarray, np.ndarray],
    dk_rows: np.ndarray,
    dv_rows: np.ndarray,
    clock: Any,
) -> None:
    """backward.key_block_grads's statements in its order (no score_mod), each timed into its part; the shares
    of dq and of P's row sums go straight into dq_rows, as the kernel's OrderedDq adds them on one thread."""
    (dq, p_sums), tiles = dq_rows, list(tiles)
    with clock(COPIES):
        (c, bk, _), height, dtype = k_j.shape, tiles[0].q_stop - tiles[0].q_start, q_lse.dtype
        k_one_t, v_one_t = ones_row_below(k_j), ones_row_below(v_j)
        (p_buf, ds_buf), ones = np.empty((2, c * height * bk), dtype), np.ones(bk, dtype)
    for t in tiles:
        rows, bq = slice(t.q_start, t.q_stop), t.q_stop - t.q_start
        p, ds = (buffer[: c * bq * bk].reshape(c, bq, bk) for buffer in (p_buf, ds_buf))
        with clock(MATMULS):
            np.matmul(q_lse[:, rows], k_one_t, out=p)
        with clock(MASKING):
            q_idx, kv_idx = np.arange(t.q_start, t.q_stop)[:, None], np.arange(t.k_start, t.k_stop)
            apply_mods(p, t, mods, q_idx, kv_idx, keys_down=False)
        with clock(EXPONENTIALS):
            np.exp(p, out=p)
        with clock(MATMULS):
            dv_share = p.transpose(0, 2, 1) @ do_d[:, rows, :-1]
        with clock(REDUCTIONS):
            dv_rows += dv_share
        with clock(MATMULS):
            np.matmul(do_d[:, rows], v_one_t, out=ds)
        with clock(REDUCTIONS):
            ds *= p
        with clock(MATMULS):
            dq_share = ds @ k_j
        with clock(REDUCTIONS):
            p_sum = p @ ones
            dq[:, rows] += dq_share
            p_sums[:, rows] += p_sum
        with clock(MATMULS):
            dk_share = ds.transpose(0, 2, 1) @ q_lse[:, rows, :-1]
        with clock(REDUCTIONS):
            dk_rows += dk_share


def measure_parts(kernel: Any, copy: Any, repeats: int, dtype: str) -> dict[str, Any]:
    """The copy's run split into parts, each the least of `repeats` runs (another process may stop any part of
    a run): each timed part, and "Python between them", a run's wall time less its parts and the timing's own
    cost; the kernel's own time on one thread (the fastest of `repeats`), whether the copy gave the kernel's
    bits, and the one-thread matmul rate, the best of one 2048 x 2048 product beside each run."""
    lap_cost, runs, rates = Stopwatch.lap_cost(), [], []
    with threadpool_limits(limits=1, user_api="blas"):  # as the kernels hold BLAS while they run
        kernel_ms = best_ms(kernel, repeats)
        for _ in range(repeats):
            rates.append(machine.matmul_rate(dtype, repeats=1))
            clock, start = Stopwatch(), time.perf_counter()
            result = copy(clock)
            wall = time.perf_counter() - start - clock.laps * lap_cost
            runs.append({**clock.seconds, PYTHON: max(wall - sum(clock.seconds.values()), 0.0)})
        same = all(np.array_equal(a, b) for a, b in zip(result, kernel(), strict=True))
    parts = {part: 1e3 * min(run.get(part, 0.0) for run in runs) for part in (*PARTS, PYTHON)}
    return {"kernel_ms": kernel_ms, "parts_ms": parts, "same_bits": same, "matmul_gflops": max(rates)}


def profile_forward(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The forward's parts on one thread, its tile steps and matmul FLOPs, and its time on every worker."""
    q, k, v, dims, plan = check_flash(
        *qkv,
        causal=not args.no_causal,
        scale=None,
        window=None,
        block_q=None,
        block_k=None,
        kv_heads_per_step=None,
        workers=None,
    )
    one = plan._replace(workers=1)
    row = measure_parts(
        lambda: flash_forward(q, k, v, dims, one),
        lambda c: forward_copy(q, k, v, dims, one, c),
        args.repeats,
        args.dtype,
    )
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv
    steps = [
        (item, t)
        for item in forward_items(dims, plan, n_kv)
        for t in plan.tile_mask.row_tiles(item[1], min(item[1] + plan.block_q, dims.n_q), dims.n_k, plan.block_k)
    ]
    heads = [min(plan.kv_heads_per_step, n_kv - h) * dims.group for (h, _), _ in steps]
    scores = sum(n * (t.q_stop - t.q_start) * (t.k_stop - t.k_start) for n, (_, t) in zip(heads, steps, strict=True))
    row.update(tiles=len(steps), flops=2 * (dims.e + dims.ev) * scores, plan=plan)
    row["all_workers_ms"] = best_ms(lambda: flash_forward(q, k, v, dims, plan), args.repeats)
    return row


def profile_backward(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """The backward's parts on one thread (dout random), its tiles and matmul FLOPs,
    its time on every worker."""
    out, lse = flash_attention(*qkv, causal=not args.no_causal, return_lse=True)
    dout = np.random.default_rng(args.seed + 1).standard_normal(out.shape).astype(out.dtype)
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        *qkv,
        out,
        dout,
        lse,
        causal=not args.no_causal,
        scale=None,
        window=None,
        block_q=None,
        block_k=None,
        workers=None,
    )
    one = plan._replace(workers=1)
    row = measure_parts(
        lambda: flex_backward(q, k, v, out, dout, lse, dims, one)[:3],  # dq, dk, dv
        lambda c: backward_copy(q, k, v, out, dout, lse, dims, one, c),
        args.repeats,
        args.dtype,
    )
    tiles = [
        t
        for k_start in range(0, dims.n_k, plan.block_k)
        for t in plan.tile_mask.column_tiles(k_start, min(k_start + plan.block_k, dims.n_k), dims.n_q, plan.block_q)
    ] * dims.hq
    scores = sum((t.q_stop - t.q_start) * (t.k_stop - t.k_start) for t in tiles)
    row.update(
        tiles=len(tiles),
        flops=2 * (3 * dims.e + 2 * dims.ev) * scores,
        plan=plan,
        heads=heads_per_item(one, dims.hq, dims.n_q, dims.n_k),
    )
    row["all_workers_ms"] = best_ms(lambda: flex_backward(q, k, v, out, dout, lse, dims, plan), args.repeats)
    return row


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
