"""The forward's tile kernel: flash_attention_one_head's Algorithm 1 (flash.py), fast. The tests hold the two
equal.

Three things make it fast, each in the margin of the loop that reads like the paper:
    several heads share each tile step   one batched matmul for the query heads of one or more kv heads
                                         (flash_plan: kv_heads_per_step, the tile rule's: _tuning.py)
    worker threads                       each takes whole (heads, query block) items (flash_forward)
    sums against 0                       no running max to find, subtract and rescale, with the running max
                                         where exp(s) cannot hold them (attend_block, trusted)

Why heads are batched: Python's per-call overhead (a few microseconds, with the interpreter lock held) is then
paid once for all of them, which is what lets worker threads scale with cores (docs/flash.md). Memory: out,
lse, and per worker one step's tile of scores (at most the step budget) plus per-row vectors:
O((L + S)·E + workers·budget), never L x S. The tiles of a query block are made as it runs (the mask's
row_tiles), so the plan itself costs no memory either.

Which tiles run is the mask's to say (_tiles.TileMask: blockmask.Band or blockmask.BlockMask); the loop
applies a score_mod to every tile and the mask_mod only to the partial ones (flex.py). A sink (a learned logit
per head that joins every row's softmax, gpt-oss) is the running state a row starts from: m = sink, l = 1, acc
= 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import _tuning
from ._checks import QKVShape, as_float_array, check_positive_int, compute_dtype, result_dtype
from ._mod_calls import modded, visible
from ._parallel import one_blas_thread, run_items
from ._tiles import FULL, Heads, TileLike, TileMask
from ._tuning import TileRule, call_workers, default_tiles

__all__ = [
    "STRIP",
    "FlashPlan",
    "GroupedHeads",
    "TileMods",
    "TileSizes",
    "apply_mods",
    "attend_block",
    "attend_tiles",
    "broadcast_kv",
    "diagonal_of",
    "finish_rows",
    "flash_forward",
    "flash_plan",
    "forward_items",
    "forward_results",
    "grouped_heads",
    "hide_past_diagonal",
    "item_parts",
    "kv_entries",
    "kv_rows",
    "plan_sizes",
    "running_start",
    "scaled_queries",
    "tile_mods",
    "tile_scores",
    "trusted",
]

Array = NDArray[np.floating]


# ---------------------------------------------------------------------------------------------------
# the plan: the sizes a call fixed or the tile rule's, the mask, the mods


class TileSizes(NamedTuple):
    """What a call may fix of its tiling; None takes the tile rule's default (_tuning.default_tiles,
    call_workers): tiles of block_q x block_k, the kv heads that share one tile step, the worker threads."""

    block_q: int | None = None
    block_k: int | None = None
    kv_heads_per_step: int | None = None
    workers: int | None = None

    def checked(self) -> TileSizes:
        """Each size given as a positive int (TypeError or ValueError naming it otherwise); None stays
        None."""
        sizes = self._asdict().items()
        return TileSizes(*(None if size is None else check_positive_int(size, name) for name, size in sizes))


class FlashPlan(NamedTuple):
    """How flash_forward runs a checked call: the scale, the tile mask (a Band or a BlockMask: which tiles
    run), the tile sizes, heads per step, workers, and flex attention's score_mod and sinks (Hq,) (None:
    none)."""

    scale: float
    tile_mask: TileMask
    block_q: int
    block_k: int
    kv_heads_per_step: int
    workers: int
    score_mod: Any = None
    sinks: np.ndarray | None = None


def flash_plan(
    dims: QKVShape,
    tile_mask: TileMask,
    scale: float,
    sizes: TileSizes | None = None,
    *,
    score_mod: Any = None,
    sinks: np.ndarray | None = None,
) -> FlashPlan:
    """The plan for checked sizes, the defaults filled in: default_tiles (a mask made for one tile size, a
    BlockMask's BLOCK_SIZE, runs in that size), and call_workers for workers. sizes: checked
    (TileSizes.checked); None: every size the rule's."""
    sizes = TileSizes() if sizes is None else sizes
    rule = _tuning.tile_rule()  # what the defaults read: a new rule, new sizes
    block_q, block_k, heads, workers = plan_sizes(dims, tile_mask.BLOCK_SIZE, diagonal_of(tile_mask), sizes, rule)
    return FlashPlan(scale, tile_mask, block_q, block_k, heads, workers, score_mod, sinks)


@functools.lru_cache(maxsize=256)
def plan_sizes(
    dims: QKVShape, block_size: tuple[int, int] | None, diagonal: int | None, sizes: TileSizes, rule: TileRule
) -> tuple[int, int, int, int]:
    """flash_plan's block_q, block_k, kv heads per step and workers, worked out once for each shape, mask kind
    (its BLOCK_SIZE and diagonal), given sizes and tile rule in force (`rule`, which default_tiles and
    call_workers read for themselves: here it is the key): every layer of a model asks the same at every
    step."""
    block_q, block_k = block_size if block_size is not None else (sizes.block_q, sizes.block_k)
    n_kv = math.prod(dims.batch) * dims.hkv
    block_q, block_k, auto_heads = default_tiles(
        dims.n_q, dims.n_k, dims.group, block_q=block_q, block_k=block_k, kv_heads=n_kv, diagonal=diagonal
    )
    heads = auto_heads if sizes.kv_heads_per_step is None else sizes.kv_heads_per_step
    return block_q, block_k, heads, call_workers(dims, sizes.workers)


def diagonal_of(tile_mask: TileMask) -> int | None:
    """TileMods.diagonal for a tile mask: the offset of a causal band without a window, else None."""
    return tile_mask.diagonal


def broadcast_kv(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
    """key and value whose batch dims are all 1 against a larger query batch (torch's SDPA and flex_attention
    allow it): as views broadcast to the query's batch dims, every batch entry reading the same keys and
    values (grouped_heads then holds them once). Anything else is left as it is, for check_qkv to judge."""
    q, k, v = as_float_array(query, "q"), as_float_array(key, "k"), as_float_array(value, "v")
    batch, kv_batch = q.shape[:-3], k.shape[:-3]
    if q.ndim == k.ndim == v.ndim >= 4 and kv_batch == v.shape[:-3] != batch and set(kv_batch) == {1}:
        return np.broadcast_to(k, (*batch, *k.shape[-3:])), np.broadcast_to(v, (*batch, *v.shape[-3:]))
    return key, value


# ---------------------------------------------------------------------------------------------------
# the work: items of (heads, query block) over worker threads


def flash_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dims: QKVShape,
    plan: FlashPlan,
) -> tuple[Array, Array]:
    """flash_attention's work on checked inputs (flash.check_flash): out (..., Hq, L, Ev) in the inputs'
    result dtype, lse (..., Hq, L) in the compute dtype."""
    ct = compute_dtype(q, k, v)
    # 1) one view of the heads, grouped by the kv head they read: query head h reads kv head h // G
    arrays = grouped_heads(q, k, v, dims, ct)

    def run(item: tuple[int, int]) -> None:
        # 2) one item: the query heads of c kv heads, one query block; the scale folded into q, transposed
        heads, rows, query_heads = item_parts(item, arrays, plan, dims.hq)
        q_t = scaled_queries(arrays.q, heads, rows, plan.scale, ct)  # (c, E, G·bq)
        kv = kv_rows(heads, arrays)  # heads, or their place in k and v held once for the batch
        out_rows, lse_rows = arrays.out[heads, :, rows], arrays.lse[heads, :, rows]
        attend_block(q_t, arrays.k[kv], arrays.v[kv], plan, query_heads, rows, out_rows, lse_rows)

    # 3) the items, longest first so that the workers finish together; each writes its own rows of out and lse
    with one_blas_thread():
        run_items(run, forward_items(dims, plan, len(arrays.q), len(arrays.k)), plan.workers)
    return forward_results(arrays, dims, result_dtype(q, k, v))


class GroupedHeads(NamedTuple):
    """flash_forward's arrays, one leading index per (batch entry, kv head), query head h reading kv head h //
    G: q (B·Hkv, G, L, E) a view of the input, k (B·Hkv, S, E) and v (B·Hkv, S, Ev) in the compute dtype
    (views where they already are), and out (B·Hkv, G, L, Ev) and lse (B·Hkv, G, L) for the items to fill. k
    and v broadcast over the batch (broadcast_kv) are held once, (Hkv, S, E): entry b·Hkv + h reads their
    entry h."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    lse: np.ndarray


def grouped_heads(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, ct: np.dtype) -> GroupedHeads:
    n_kv, g = math.prod(dims.batch) * dims.hkv, dims.group  # every (batch, kv head) pair
    return GroupedHeads(
        q.reshape(n_kv, g, dims.n_q, dims.e),  # (B·Hkv, G, L, E)
        kv_entries(k, len(dims.batch), ct),  # (B·Hkv, S, E), or (Hkv, S, E) broadcast over the batch
        kv_entries(v, len(dims.batch), ct),  # (B·Hkv, S, Ev), or (Hkv, S, Ev)
        np.empty((n_kv, g, dims.n_q, dims.ev), ct),  # (B·Hkv, G, L, Ev)
        np.empty((n_kv, g, dims.n_q), ct),  # (B·Hkv, G, L)
    )


def kv_entries(x: np.ndarray, batch_dims: int, ct: np.dtype) -> np.ndarray:
    """x (..., Hkv, S, E) as (B·Hkv, S, E) in the compute dtype, a view where it already is one; x broadcast
    over its batch dims (stride 0: every entry the same array) as its one entry (Hkv, S, E), never B
    copies."""
    batch = x.shape[:batch_dims]  # (an empty x has no strides to go by: it stays as it is)
    if x.size and all(stride == 0 or n == 1 for n, stride in zip(batch, x.strides, strict=False)):
        x = x[(0,) * batch_dims]  # (Hkv, S, E): one batch entry, or the one every entry reads
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:]), dtype=ct)


def kv_rows(heads: slice, arrays: GroupedHeads) -> slice:
    """The entries of arrays.k and arrays.v that the kv heads `heads` read: the same, or where k and v are
    held once for the batch (kv_entries), their place in it (an item never spans two batch entries then)."""
    start = heads.start % len(arrays.k)
    return slice(start, start + heads.stop - heads.start)


def item_parts(
    item: tuple[int, int],
    arrays: GroupedHeads,
    plan: FlashPlan,
    hq: int,
) -> tuple[slice, slice, Heads]:
    """One work item (first kv head, query block start) as slices: its kv heads (within one batch entry where
    k and v are held once for the batch) and its query rows, and its c·G query heads as (batch entry, query
    head) pairs, kv head by kv head."""
    n_kv, g, n_q = arrays.q.shape[:3]
    entry_end = (item[0] // len(arrays.k) + 1) * len(arrays.k)  # n_kv, unless k and v are held once
    heads = slice(item[0], min(item[0] + plan.kv_heads_per_step, n_kv, entry_end))
    rows = slice(item[1], min(item[1] + plan.block_q, n_q))
    query_heads = np.arange(heads.start * g, heads.stop * g)  # (c·G,) their (batch, query head) pairs, flat
    return heads, rows, Heads(query_heads // hq, query_heads % hq)


def scaled_queries(q_heads: np.ndarray, heads: slice, rows: slice, scale: float, ct: np.dtype) -> np.ndarray:
    """The queries of one item, times the scale, transposed (queries across) -> q_t (c, E, G·bq)."""
    c, g, bq, e = heads.stop - heads.start, q_heads.shape[1], rows.stop - rows.start, q_heads.shape[3]
    q_t = np.empty((c, e, g, bq), ct)  # (c, E, G, bq): column g·bq + i is query i of head g
    np.multiply(q_heads[heads, :, rows].transpose(0, 3, 1, 2), scale, out=q_t, dtype=ct)
    return q_t.reshape(c, e, g * bq)


def forward_results(arrays: GroupedHeads, dims: QKVShape, dtype: Any) -> tuple[Array, Array]:
    """out (..., Hq, L, Ev) in the result dtype and lse (..., Hq, L), from the grouped arrays the items
    filled."""
    out = arrays.out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(dtype, copy=False)
    return out, arrays.lse.reshape(*dims.batch, dims.hq, dims.n_q)


def forward_items(
    dims: QKVShape,
    plan: FlashPlan,
    n_kv: int,
    kv_held: int | None = None,
) -> list[tuple[int, int]]:
    """(first kv head, query block start) for every item of n_kv kv heads; the query blocks with the most
    tiles come first. kv_held: the entries of k and v (kv_entries; default n_kv): an item's heads stay in one
    of them."""
    q_starts = range(0, dims.n_q, plan.block_q)
    rows = plan.tile_mask.row_length
    length = {q: rows(q, min(q + plan.block_q, dims.n_q), dims.n_k, plan.block_k) for q in q_starts}
    ordered = sorted(q_starts, key=lambda q_start: -length[q_start])
    held = max(1, kv_held or n_kv)
    firsts = [entry + h for entry in range(0, n_kv, held) for h in range(0, held, plan.kv_heads_per_step)]
    return [(h, q_start) for q_start in ordered for h in firsts]


# ---------------------------------------------------------------------------------------------------
# one item: the online softmax of one query block of several heads, over the tiles that run


def attend_block(
    q_t: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    plan: FlashPlan,
    heads: Heads,
    rows: slice,
    out_rows: np.ndarray,
    lse_rows: np.ndarray,
) -> None:
    """The softmax of one query block (rows) of c kv heads, each with its G query heads, over the tiles that
    plan.tile_mask says run for those heads.

    q_t (c, E, G·bq): the scaled queries, transposed; column g·bq + i is query i of head g of the group.
    k (c, S, E), v (c, S, Ev): the c kv heads; heads: the c·G query heads, kv head by kv head. Writes
    out_rows (c, G, bq, Ev) and lse_rows (c, G, bq).

    Why this is fast: the sums are first measured against 0, not against the running max (attend_tiles with
    running_max=False). The reference point cancels in acc / l, so any m gives the softmax; with m = 0 for
    every row and every tile (FlashDecoding++, Hong et al. 2023, section 3: a "unified max value"), nothing is
    found, subtracted or rescaled, and a tile is two matmuls, one exponential and one row sum:
        l   += Σ_keys exp(s)          acc += exp(s) @ v_tile          out = acc / l,  lse = log l
    m = 0 holds as long as exp(s) neither overflows nor leaves a row with nothing but underflowed terms;
    the sums say when it did not (trusted), and then the block is done again with the running max, so the
    result is the online softmax's either way.
    """
    c, _, n = q_t.shape
    acc = np.empty((c, n, v.shape[-1]), q_t.dtype)  # (c, n, Ev) Σ exp(s - m) v, filled by attend_tiles
    m, l = attend_tiles(q_t, k, v, plan, heads, rows, acc, running_max=False)
    if not trusted(l, acc):  # exp(s) overflowed, or a row's terms all underflowed: again with the running max
        m, l = attend_tiles(q_t, k, v, plan, heads, rows, acc, running_max=True)
    finish_rows(acc, m, l, out_rows, lse_rows)


def attend_tiles(
    q_t: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    plan: FlashPlan,
    heads: Heads,
    rows: slice,
    acc: np.ndarray,
    *,
    running_max: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The tile loop of attend_block: fills acc (c, n, Ev) with Σ exp(s - m) v and returns m and l (c, n), the
    reference point and Σ exp(s - m) of each row. running_max=False: m = 0 throughout (steps 3 and 5 skipped);
    True: flash.py's running max, m moved and what was summed rescaled at every tile.
    The score tile is kept transposed, keys down and queries across: (c, bk, n); BLAS sums its columns
    (ones @ s) faster than NumPy sums an axis.
    """
    c, _, n = q_t.shape
    dtype = q_t.dtype
    mods, q_idx = tile_mods(plan, heads, rows, c)
    m, l = running_start(plan.sinks, heads.h, rows.stop - rows.start, dtype)  # (c·n,) each
    m, l = m.reshape(c, n), l.reshape(c, n)
    if not running_max:  # a sink's term exp(sink) measured against 0 (no sink: 0), and m = 0 from here on
        l *= np.exp(m)
        m = np.zeros_like(m)
    written = False  # acc holds a tile's sum: the first tile's matmul writes it, nothing is zeroed to add to
    tile_buf = np.empty(c * min(plan.block_k, k.shape[1]) * n, dtype)  # the one score tile, reused
    ones = np.ones(min(plan.block_k, k.shape[1]), dtype)  # (bk,) sums the keys of a tile in one matmul
    with np.errstate(over="ignore", invalid="ignore"):  # against 0, an overflow shows in the sums (trusted)
        for t in plan.tile_mask.row_tiles(rows.start, rows.stop, k.shape[1], plan.block_k, heads):
            # 1) scores of this tile for every head of the step, 2) the mods (tile_scores)
            s = tile_scores(k, q_t, t, tile_buf, mods, q_idx)  # (c, bk, n): s[h, j, g·bq + i] = q_{g,i} · k_j
            if running_max:
                # 3) the new running max. A row that has seen no key yet keeps m' = -inf; it subtracts
                #    the lowest finite number instead: exp(-inf - lowest) = 0, not exp(-inf + inf) = NaN.
                m_new = np.maximum(m, s.max(axis=1))  # (c, n)
                m_safe = np.maximum(m_new, np.finfo(dtype).min)  # (c, n)
                s -= m_safe[:, None, :]  # (c, bk, n) - (c, 1, n): each column is one query
            # 4) P̃ = exp(s - m) in place. (Not exp2 with log2(e) folded into q, as GPU kernels do: NumPy's
            #    exp2 falls to a slow path where results underflow; docs/flash.md says more.)
            np.exp(s, out=s)
            if running_max:
                # 5) rescale what was summed against the old max; 0 where m was -inf, and l, acc are 0 then
                alpha = np.exp(m - m_safe)  # (c, n)
                l *= alpha
                if written:
                    acc *= alpha[:, :, None]
                m = m_new
            # 6) add the tile's row sums and its weighted values
            l += ones[: t.k_stop - t.k_start] @ s  # (bk,) @ (c, bk, n) -> (c, n)
            if written:  # (c, n, bk) @ (c, bk, Ev); BLAS reads sᵀ
                acc += s.transpose(0, 2, 1) @ v[:, t.k_start : t.k_stop]
            else:
                np.matmul(s.transpose(0, 2, 1), v[:, t.k_start : t.k_stop], out=acc)
                written = True
    if not written:  # no tile ran: every row saw no key
        acc[...] = 0
    return m, l


def running_start(
    sinks: np.ndarray | None,
    h: np.ndarray,
    rows: int,
    dtype: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """m and l before the first tile, for the query heads h (n,) with `rows` queries each -> (n·rows,) each:
    no key seen (m = -inf, l = 0), or the head's sink already in the sum (m = sink, l = exp(sink - sink) =
    1)."""
    if sinks is None:
        return np.full(h.size * rows, -np.inf, dtype), np.zeros(h.size * rows, dtype)
    return np.repeat(sinks[h], rows).astype(dtype), np.ones(h.size * rows, dtype)


def trusted(l: np.ndarray, acc: np.ndarray) -> bool:
    """Whether sums against 0 hold every row's softmax: nothing overflowed (l and acc finite; a NaN from the
    inputs fails too) and l ≥ √tiny (1.1e-19 in float32), far above the underflow. Underflow costs out at most
    S·(smallest subnormal) / l absolute, below √tiny·S then. A row that saw no key (l = 0) fails: the
    running max sorts it out from one whose terms all underflowed."""
    above_underflow = bool((l >= np.sqrt(np.finfo(l.dtype).tiny)).all())
    return above_underflow and bool(np.isfinite(l).all() and np.isfinite(acc).all())


def finish_rows(
    acc: np.ndarray,
    m: np.ndarray,
    l: np.ndarray,
    out_rows: np.ndarray,
    lse_rows: np.ndarray,
) -> None:
    """7) Divide once at the end: out = acc / l, lse = m + log l; a row that saw no key (l = 0) gets out 0
    and lse -inf. (Test l == 0, not l > 0: a NaN in the inputs must stay NaN, not turn into a quiet 0.)"""
    acc = acc.reshape(out_rows.shape)  # (c, G, bq, Ev)
    m, l = m.reshape(lse_rows.shape), l.reshape(lse_rows.shape)  # (c, G, bq)
    empty = l == 0  # (c, G, bq)
    if not empty.any():  # every row saw a key (the usual case): no row to leave out
        np.divide(acc, l[..., None], out=out_rows)
        np.add(m, np.log(l), out=lse_rows)
        return
    np.divide(acc, l[..., None], out=out_rows, where=~empty[..., None])
    out_rows[empty] = 0.0
    with np.errstate(divide="ignore"):
        lse_rows[...] = np.where(empty, -np.inf, m + np.log(l))


# ---------------------------------------------------------------------------------------------------
# the mods of one tile


class TileMods(NamedTuple):
    """What rewrites a tile's scores: score_mod (or None) on every tile, the mask's mask_mod on a partial one,
    called with b and h, the batch entry and query head of the tile's rows, shaped to broadcast against it.
    diagonal: the offset of a causal band without a window (mask_mod is then causal_band(diagonal)), whose
    partial tiles are hidden by slices (hide_past_diagonal); None for any other mask."""

    mask_mod: Any
    score_mod: Any
    b: Any
    h: Any
    diagonal: int | None = None


def tile_mods(plan: FlashPlan, heads: Heads, rows: slice, c: int) -> tuple[TileMods, np.ndarray]:
    """The mods of a block's tiles, with b and h shaped (c, 1, G, 1) to broadcast against a tile's (c, bk, G,
    bq) view, and the block's query positions q_idx (1, 1, 1, bq)."""
    b, h = heads.b.reshape(c, 1, -1, 1), heads.h.reshape(c, 1, -1, 1)
    mods = TileMods(plan.tile_mask.mask_mod, plan.score_mod, b, h, diagonal_of(plan.tile_mask))
    return mods, np.arange(rows.start, rows.stop).reshape(1, 1, 1, -1)


def tile_scores(
    k: np.ndarray, q_t: np.ndarray, t: TileLike, tile_buf: np.ndarray, mods: TileMods, q_idx: np.ndarray
) -> np.ndarray:
    """Tile t's scores in tile_buf: 1) s = k_tile q_t for the c heads of the step (the scale already in q),
    2) the score_mod, and -inf where the mask_mod hides a key (apply_mods) -> s (c, bk, n)."""
    c, _, n = q_t.shape
    bk = t.k_stop - t.k_start
    s = tile_buf[: c * bk * n].reshape(c, bk, n)  # (c, bk, n)
    np.matmul(k[:, t.k_start : t.k_stop], q_t, out=s)  # (c, bk, E) @ (c, E, n)
    kv_idx = np.arange(t.k_start, t.k_stop).reshape(1, bk, 1, 1)
    by_head = s.reshape(c, bk, -1, q_idx.shape[-1])  # (c, bk, G, bq): a view
    apply_mods(by_head, t, mods, q_idx, kv_idx, keys_down=True)
    return s


def apply_mods(
    s: np.ndarray, tile: TileLike, mods: TileMods, q_idx: np.ndarray, kv_idx: np.ndarray, *, keys_down: bool
) -> None:
    """In place: s = score_mod(s, b, h, q_idx, kv_idx) for every score of the tile, then -inf where the
    mask_mod hides a key, in a tile a mask edge crosses. exp(-inf - m) = 0: a hidden key gets no weight.
    keys_down: s is laid out (c, bk, G, bq) (the forward's tiles), else (c, bq, bk) (the backward's)."""
    if mods.score_mod is not None:
        np.copyto(s, modded(mods.score_mod, s, mods.b, mods.h, q_idx, kv_idx), casting="same_kind")
    if tile.kind == FULL:
        return
    if mods.diagonal is not None:
        hide_past_diagonal(s, tile, mods.diagonal, keys_down=keys_down)
    else:
        np.copyto(s, -np.inf, where=~visible(mods.mask_mod, mods.b, mods.h, q_idx, kv_idx))


STRIP = 32  # rows of a tile that hide_past_diagonal masks at once


def hide_past_diagonal(s: np.ndarray, tile: TileLike, offset: int, *, keys_down: bool) -> None:
    """In place, -inf where key j > query i + offset: what causal_band(offset) hides, by slices. Query row r
    of the tile sees its key column k when k <= r + e, e = q_start + offset - k_start. STRIP rows at a time,
    the columns that every row of the strip hides are one slice, filled, and only the staircase beside them
    goes through a mask (np.copyto with where= costs several fills per element).
    s: keys down (c, bk, G, bq), key row r hiding query columns q < r - e; or queries down (c, bq, bk)."""
    e = tile.q_start + offset - tile.k_start
    n_rows, n_cols = s.shape[1], s.shape[-1]
    for r0 in range(0, n_rows, STRIP):
        r1 = min(r0 + STRIP, n_rows)
        rows = np.arange(r0, r1).reshape(-1, *(1,) * (s.ndim - 2))  # (strip, 1) or (strip, 1, 1): one per row
        if keys_down:  # every row hides the columns before r0 - e; the staircase is r0 - e .. r1 - 1 - e
            full, stair = min(max(r0 - e, 0), n_cols), min(max(r1 - 1 - e, 0), n_cols)
            s[:, r0:r1, ..., :full] = -np.inf
            np.copyto(s[:, r0:r1, ..., full:stair], -np.inf, where=np.arange(full, stair) < rows - e)
        else:  # every row hides the columns from r1 + e; the staircase is r0 + e + 1 .. r1 + e
            stair, full = min(max(r0 + e + 1, 0), n_cols), min(max(r1 + e, 0), n_cols)
            s[:, r0:r1, full:] = -np.inf
            np.copyto(s[:, r0:r1, stair:full], -np.inf, where=np.arange(stair, full) > rows + e)
