"""Where the attention kernels' time goes: flash attention's forward and backward tile loops, and the decode
step's block loop (flash_decode's, and the MLA step's around it), copied statement for statement with every
NumPy call timed into its part (the matmuls, the exponentials, the reductions and rescaling, the masking, the
copies and set-up), on one thread and on the tiles the kernels choose. The copies call the kernels' own
helpers and must give the kernels' bits (measure_parts checks it); "Python between them" is the rest of a run
(the loop, the slicing, the calls), less the timing's own cost. scripts/tiles.py --profile prints it, with
each kernel's time as a multiple of its products' (products_ratio): what lies between the products is ours,
the products are the BLAS's.

    profile_forward(qkv, causal=True, repeats=3, matmul_rate=...)   -> the forward's parts, tiles and FLOPs
    profile_backward(qkv, causal=True, repeats=3, matmul_rate=...)  -> the backward's
    profile_decode(q, k, v, repeats=3, matmul_rate=...)             -> a decode step's (flash_decode's engine)
    profile_mla(q_nope, q_rope, latent, w_ukv, repeats=3, ...)      -> the MLA decode step's (absorbed form)
    products_ratio(row)                                             -> the run's time / its matmuls' time
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from ._backward_kernel import (
    check_weights_sum_to_one,
    flex_backward,
    heads_per_item,
    item_heads,
    ones_row_below,
    query_rows,
)
from ._checks import QKVShape, check_positive_int
from ._decode_kernel import block_keys, block_scores, decode
from ._flash_kernel import (
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
from ._tiles import Heads
from ._tuning import decode_layout
from .backward import check_flash_backward
from .flash import check_flash, flash_attention
from .latent import absorb_query, split_ukv
from .measure import time_calls

__all__ = [
    "PARTS",
    "PYTHON",
    "Stopwatch",
    "measure_parts",
    "products_ratio",
    "profile_backward",
    "profile_decode",
    "profile_forward",
    "profile_mla",
]

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


def profile_forward(
    qkv: tuple[np.ndarray, ...], *, causal: bool, repeats: int, matmul_rate: Callable[[], float]
) -> dict[str, Any]:
    """The forward's parts on one thread (measure_parts), its tile steps and matmul FLOPs, and its time on every
    worker, for q, k, v = qkv."""
    q, k, v = qkv
    q, k, v, dims, plan = check_flash(
        q,
        k,
        v,
        causal=causal,
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
        repeats,
        matmul_rate,
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
    row["all_workers_ms"] = best_ms(lambda: flash_forward(q, k, v, dims, plan), repeats)
    return row


def profile_backward(
    qkv: tuple[np.ndarray, ...], *, causal: bool, repeats: int, matmul_rate: Callable[[], float], seed: int = 0
) -> dict[str, Any]:
    """The backward's parts on one thread (measure_parts; dout random, from seed), its tiles and matmul FLOPs,
    its time on every worker, for q, k, v = qkv."""
    q, k, v = qkv
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    dout = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype)
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        q,
        k,
        v,
        out,
        dout,
        lse,
        causal=causal,
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
        repeats,
        matmul_rate,
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
    row["all_workers_ms"] = best_ms(lambda: flex_backward(q, k, v, out, dout, lse, dims, plan), repeats)
    return row


def measure_parts(
    kernel: Any, copy: Any, repeats: int, matmul_rate: Callable[[], float], parts: tuple[str, ...] = PARTS
) -> dict[str, Any]:
    """The copy's run split into `parts`, each the least of `repeats` runs (another process may stop any part of
    a run), each run after an untimed one (the matmul rate's product beside it leaves the caches cold): each
    timed part, and "Python between them", a run's wall time less its parts and the timing's own cost; the
    kernel's own time on one thread (the fastest of `repeats`), whether the copy gave the kernel's bits, and
    the one-thread matmul rate, the best of matmul_rate() (GFLOP/s of a large product) beside each run."""
    repeats = check_positive_int(repeats, "repeats")
    lap_cost, runs, rates = Stopwatch.lap_cost(), [], []
    with threadpool_limits(limits=1, user_api="blas"):  # as the kernels hold BLAS while they run
        kernel_ms = best_ms(kernel, repeats)
        for _ in range(repeats):
            rates.append(matmul_rate())
            copy(Stopwatch())  # untimed: the caches warm again after the large matmul, as for the kernel's runs
            clock, start = Stopwatch(), time.perf_counter()
            result = copy(clock)
            wall = time.perf_counter() - start - clock.laps * lap_cost
            runs.append({**clock.seconds, PYTHON: max(wall - sum(clock.seconds.values()), 0.0)})
        same = all(np.array_equal(a, b) for a, b in zip(result, kernel(), strict=True))
    parts_ms = {part: 1e3 * min(run.get(part, 0.0) for run in runs) for part in (*parts, PYTHON)}
    return {"kernel_ms": kernel_ms, "parts_ms": parts_ms, "same_bits": same, "matmul_gflops": max(rates)}


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
        kv = kv_rows(heads, arrays)
        block_copy(
            q_t,
            arrays.k[kv],
            arrays.v[kv],
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
    """_flash_kernel.attend_block's statements in its order, each timed into its part (tile_scores split in
    two: its matmul and its mods). The fallback it never needs on these inputs is left out: the bits would
    tell."""
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
    """_backward_kernel.key_block_grads's statements in its order (no score_mod), each timed into its part;
    the shares of dq and of P's row sums go straight into dq_rows, as the kernel's OrderedDq adds them on one
    thread."""
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


def products_ratio(row: dict[str, Any]) -> float:
    """A profiled run's time over its products' (the matmuls'): 1.25 where what lies between them (exponentials,
    reductions, rescaling, masks, copies, Python) takes a quarter of the products' own time."""
    parts = row["parts_ms"]
    return sum(parts.values()) / parts[MATMULS] if parts[MATMULS] > 0 else float("inf")


# ---------------------------------------------------------------------------------------------------
# the decode step: one query per head against a cache, in blocks of keys (_decode_kernel.py)


def profile_decode(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, repeats: int, matmul_rate: Callable[[], float]
) -> dict[str, Any]:
    """flash_decode's engine on one thread, one chunk of keys (kv_splits=1, as one worker takes them), split
    into parts: q (B, Hq, L, E) against k (B, Hkv, S, E), v (B, Hkv, S, Ev), float32 or float64."""
    dims = decode_dims(q, k, v)
    scale = 1.0 / float(np.sqrt(dims.e))
    row = measure_parts(
        lambda: decode(q, k, v, dims, scale, 1, 1),
        lambda clock: decode_copy(q, k, v, dims, scale, clock),
        repeats,
        matmul_rate,
    )
    n_kv, rows = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv, dims.group * dims.n_q
    step = block_keys(n_kv * rows)
    row.update(tiles=-(-dims.n_k // step), flops=2 * (dims.e + dims.ev) * n_kv * rows * dims.n_k, block_k=step)
    return row


def decode_dims(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> QKVShape:
    """The QKVShape of q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)."""
    return QKVShape(q.shape[:1], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])


def decode_copy(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, scale: float, clock: Any) -> Any:
    """_decode_kernel.decode with one chunk, its statements in its order, each timed into its part: out (B·Hkv,
    G·L, Ev) and lse (B·Hkv, G·L), the kernel's bits."""
    ct = np.result_type(q, k, v, np.float32)
    n_kv, rows = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv, dims.group * dims.n_q
    with clock(COPIES):
        q_s = np.multiply(q.reshape(n_kv, rows, dims.e), scale, dtype=ct)  # (N, R, E)
        k_c, v_c = k.reshape(n_kv, dims.n_k, dims.e), v.reshape(n_kv, dims.n_k, dims.ev)
    return blocks_copy(q_s, k_c, v_c, clock)  # one chunk: its out and lse are the result


def blocks_copy(q_s: np.ndarray, k: np.ndarray, v: np.ndarray, clock: Any) -> tuple[np.ndarray, np.ndarray]:
    """attend_chunk's blocks through attend_blocks' sums against 0, each statement timed into its part (the
    fallback it never needs on these inputs is left out: the bits would tell)."""
    n, rows = q_s.shape[:2]
    step, keys_first = block_keys(n * rows), decode_layout().keys_first
    with clock(COPIES):
        m, l = np.zeros((n, rows, 1), q_s.dtype), np.zeros((n, rows, 1), q_s.dtype)
        acc = np.empty((n, rows, v.shape[-1]), q_s.dtype)
        acc[...] = 0
        part = np.empty_like(acc)
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, k.shape[1], step):
            k_b, v_b = k[:, start : start + step], v[:, start : start + step]
            bounds = np.cumsum([0, k_b.shape[1]])
            with clock(MATMULS):
                s = block_scores(q_s, [k_b], bounds, keys_first)  # (N, R, bk)
            with clock(EXPONENTIALS):
                np.exp(s, out=s)
            with clock(REDUCTIONS):
                l += s.sum(axis=-1, keepdims=True)
            with clock(MATMULS):
                pv = np.matmul(s, v_b.astype(q_s.dtype, copy=False), out=part)
            with clock(REDUCTIONS):
                acc += pv
    with clock(REDUCTIONS):
        trusted(l, acc)
        np.divide(acc, l, out=acc, where=l != 0)
        lse = (m + np.log(l))[..., 0]
    return acc, lse


def profile_mla(
    q_nope: np.ndarray,
    q_rope: np.ndarray,
    latent: np.ndarray,
    w_ukv: np.ndarray,
    *,
    repeats: int,
    matmul_rate: Callable[[], float],
    scale: float | None = None,
) -> dict[str, Any]:
    """The MLA decode step of the absorbed form (latent.attend_latent, one new token) on one thread, one chunk
    of keys, split into parts: the query absorbed (q_nope W_UKᵀ), the decode over the latents, then W_UV.
    q_nope (B, H, 1, d_nope), q_rope (B, H, 1, d_rope), latent (B, 1, S, r + d_rope), W_UKV (r, H·(d_nope +
    d_v)); scale: default 1/√(d_nope + d_rope)."""
    n_heads, d_nope, r = q_nope.shape[1], q_nope.shape[-1], w_ukv.shape[0]
    scale = 1.0 / float(np.sqrt(d_nope + q_rope.shape[-1])) if scale is None else scale
    w_uk, w_uv = split_ukv(w_ukv, n_heads, d_nope)  # (H, r, d_nope), (H, r, d_v)

    def step(clock: Any) -> np.ndarray:
        with clock(MATMULS):
            q_latent = q_nope @ w_uk.swapaxes(-1, -2)  # (B, H, 1, r)
        with clock(COPIES):
            q = np.concatenate([q_latent, q_rope.astype(q_latent.dtype, copy=False)], axis=-1)
            k, v = latent, latent[..., :r]
            dims = decode_dims(q, k, v)
        out, _ = decode_copy(q, k, v, dims, scale, clock)
        with clock(MATMULS):
            return out.reshape(*q.shape[:-1], r) @ w_uv  # (B, H, 1, r) @ (H, r, d_v)

    def kernel() -> np.ndarray:  # the engines attend_latent runs, one chunk of keys
        q = absorb_query(q_nope, q_rope, w_uk)  # (B, H, 1, r + d_rope)
        out, _ = decode(q, latent, latent[..., :r], decode_dims(q, latent, latent[..., :r]), scale, 1, 1)
        return out.reshape(*q.shape[:-1], r) @ w_uv

    row = measure_parts(lambda: (kernel(),), lambda clock: (step(clock),), repeats, matmul_rate)
    B, S = q_nope.shape[0], latent.shape[2]
    absorbed = 2 * B * n_heads * (d_nope * r + r * w_uv.shape[-1])  # the two projections of the query and out
    row.update(
        tiles=-(-S // block_keys(B * n_heads)), flops=absorbed + 2 * (2 * r + q_rope.shape[-1]) * B * n_heads * S
    )
    return row
