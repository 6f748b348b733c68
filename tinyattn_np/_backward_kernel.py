"""The backward's key-block engine: flash_attention_backward_one_head's Algorithm 2 (backward.py), fast, with
every key block of every head a work item on worker threads. The tests hold the two equal.

    flex_backward      the blockwise backward on checked inputs: the query side made once (query_rows), the
                       items run (run_key_blocks), the sinks' gradients, P's row sums checked, FlexGrads
    key_block_grads    Algorithm 2's inner loop for one key block over the query blocks that see it, for the
                       heads of one item, each matmul one batched call
    OrderedDq          the dq rows each key block adds to, added in key-block order whatever the threads'
                       timing (a wavefront): the same bits for any number of workers

Which tiles run is the mask's (_tiles.TileMask), as in the forward's kernel (_flash_kernel.py), whose
apply_mods the tiles share; through a score_mod, the chain rule of mod_grads.py on every tile
(through_score_mod).
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import _tuning
from ._atomic import holding
from ._checks import QKVShape, compute_dtype
from ._flash_kernel import TileMods, apply_mods, diagonal_of
from ._mod_calls import derivative_of
from ._parallel import Stopped, one_blas_thread, run_items
from ._tiles import Heads, TileLike, TileMask
from ._tuning import TileRule, backward_heads_per_item

__all__ = [
    "BackwardPlan",
    "FlexGrads",
    "ItemHeads",
    "OrderedDq",
    "band_heads_per_item",
    "call_heads",
    "check_weights_sum_to_one",
    "flex_backward",
    "heads_per_item",
    "item_heads",
    "key_block_grads",
    "ones_row_below",
    "query_rows",
    "run_key_blocks",
    "sink_grads",
    "through_score_mod",
]

Array = NDArray[np.floating]


class FlexGrads(NamedTuple):
    """What flex_attention_backward returns (and attention_backward's math, backward.attention_grads): dq, dk,
    dv like q, k, v; dscore_mod, the gradient of the score_mod's learned parameters (shaped like
    score_mod.params; None when it has none); dsinks (Hq,) (None without sinks)."""

    dq: Array
    dk: Array
    dv: Array
    dscore_mod: Array | None
    dsinks: Array | None


class BackwardPlan(NamedTuple):
    """How flex_backward runs a checked call: the scale, the tile mask (a Band or a BlockMask), the tile
    sizes, the workers, and flex attention's score_mod (one that gives its derivative) and sinks (Hq,)."""

    scale: float
    tile_mask: TileMask
    block_q: int
    block_k: int
    workers: int
    score_mod: Any = None
    sinks: np.ndarray | None = None


def flex_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    dims: QKVShape,
    plan: BackwardPlan,
) -> FlexGrads:
    """The blockwise backward on checked inputs: FlexGrads of the forward that plan describes."""
    ct = compute_dtype(q, k, v, out, dout)
    n_heads = math.prod(dims.batch) * dims.hq  # every (batch, query head) pair
    n_kv_heads, group = n_heads // dims.group, dims.group
    # 1) inputs in the compute dtype, one head per leading index (views when they already are)
    k_c = np.ascontiguousarray(k.reshape(n_kv_heads, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv_heads, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    # 2) the query side: [q times the scale, −lse] and [dout, −D], D = rowsum(dO ∘ O), once for all tiles
    lse_column = plan.score_mod is None  # a score_mod needs S itself: L_i comes off after it
    q_lse, do_d, d, lse_c = query_rows(q, out, dout, lse, dims, plan.scale, ct, lse_column=lse_column)
    # the sums the workers add into, zeroed here by this thread (np.full, not np.zeros): new memory is mapped
    # page by page where it is first written, and pages first written by several threads at once wait on
    # one another in the kernel, which can make two workers slower than one
    dq = np.full((n_heads, dims.n_q, dims.e), 0, ct)  # (B·Hq, L, E)
    p_sums = np.zeros((n_heads, dims.n_q), ct)  # (B·Hq, L)
    # dk, dv per query head (summed over the group below when G > 1, else the result itself)
    dk_heads = np.full((n_heads, dims.n_k, dims.e), 0, ct)  # (B·Hq, S, E)
    dv_heads = np.full((n_heads, dims.n_k, dims.ev), 0, ct)  # (B·Hq, S, Ev)
    params = getattr(plan.score_mod, "params", None)  # learned: a gradient per (head, key block), in order
    n_k_blocks = -(-dims.n_k // plan.block_k)
    param_grads = None if params is None else np.zeros((n_heads, n_k_blocks, *params.shape[1:]), ct)
    # 3) every key block of every head, a work item
    run_key_blocks(q_lse, k_c, v_c, do_d, lse_c, dq, p_sums, dk_heads, dv_heads, plan, dims.hq, param_grads)
    dsinks = sink_grads(p_sums, lse_c, d, dims, plan.sinks)  # adds the sink's weight to p_sums first
    check_weights_sum_to_one(p_sums, lse_c)
    # 4) dQ's scale, once; a kv head's gradient is the sum over its G query heads (in head order)
    dq *= plan.scale
    dk_c = dk_heads.reshape(n_kv_heads, group, dims.n_k, dims.e).sum(axis=1) if group > 1 else dk_heads
    dv_c = dv_heads.reshape(n_kv_heads, group, dims.n_k, dims.ev).sum(axis=1) if group > 1 else dv_heads
    # 5) a learned score_mod's gradient: key blocks in order, then the batch entries (one parameter per head)
    dparams = None
    if params is not None and param_grads is not None:
        dparams = param_grads.sum(axis=1).reshape(-1, *params.shape).sum(axis=0)
    dq_out = dq.reshape(q.shape).astype(q.dtype, copy=False)
    dk_out = dk_c.reshape(k.shape).astype(k.dtype, copy=False)
    return FlexGrads(dq_out, dk_out, dv_c.reshape(v.shape).astype(v.dtype, copy=False), dparams, dsinks)


def query_rows(
    q: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    dims: QKVShape,
    scale: float,
    ct: np.dtype,
    *,
    lse_column: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the blockwise backward reads on the query side, in the compute dtype ct, one head per leading
    index, made once for every tile: q_lse = [q · scale, −lse] (B·Hq, L, E + 1), do_d = [dout, −D] (B·Hq, L,
    Ev + 1) with D = rowsum(dO ∘ O), and D and lse (B·Hq, L) themselves, lse a copy with +inf where it was
    -inf. The extra columns are what key_block_grads' matmuls take off (q_lse[..., :-1] is q · scale, a view);
    lse_column=False puts 0 there instead of −lse (a score_mod needs S itself). The ring's backward makes its
    rows with it too."""
    n_heads = math.prod(dims.batch) * dims.hq  # every (batch, query head) pair
    q_lse = np.empty((n_heads, dims.n_q, dims.e + 1), ct)  # (B·Hq, L, E + 1)
    do_d = np.empty((n_heads, dims.n_q, dims.ev + 1), ct)  # (B·Hq, L, Ev + 1)
    np.multiply(q.reshape(n_heads, dims.n_q, dims.e), scale, out=q_lse[..., :-1], dtype=ct)  # scale folded in
    do_d[..., :-1] = dout.reshape(n_heads, dims.n_q, dims.ev)
    # D once for all tiles (einsum: no (B·Hq, L, Ev) product in memory)
    out_c = out.reshape(n_heads, dims.n_q, dims.ev).astype(ct, copy=False)  # (B·Hq, L, Ev)
    d = np.einsum("hle,hle->hl", do_d[..., :-1], out_c)  # (B·Hq, L)
    # a row that saw no key has lse = -inf; +inf instead makes its P = exp(S − lse) exactly 0, not NaN
    lse_c = lse.reshape(n_heads, dims.n_q).astype(ct)  # (B·Hq, L), a copy we may change
    lse_c[np.isneginf(lse_c)] = np.inf
    if lse_column:
        np.negative(lse_c, out=q_lse[..., -1])
    else:
        q_lse[..., -1] = 0.0
    np.negative(d, out=do_d[..., -1])
    return q_lse, do_d, d, lse_c


def run_key_blocks(
    q_lse: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    do_d: np.ndarray,
    lse: np.ndarray,
    dq: np.ndarray,
    p_sums: np.ndarray,
    dk_heads: np.ndarray,
    dv_heads: np.ndarray,
    plan: BackwardPlan,
    hq: int,
    param_grads: np.ndarray | None = None,
) -> None:
    """Algorithm 2 with every key block of every head a work item (key_block_grads), on plan.workers threads;
    where every head has the same tiles, an item takes c heads at once (heads_per_item). q_lse (B·Hq, L, E +
    1), do_d (B·Hq, L, Ev + 1) and lse (B·Hq, L) are query_rows', k (B·Hkv, S, E) and v (B·Hkv, S, Ev) as
    key_block_grads takes them. Adds into dq (B·Hq, L, E) and p_sums (B·Hq, L), in key-block order
    (OrderedDq), into dk_heads (B·Hq, S, E) and dv_heads (B·Hq, S, Ev), the shares of each query head, and
    into param_grads (B·Hq, key blocks, ...) for a learned score_mod. hq: query heads per batch entry, for a
    mask or mod that differs between heads. The ring's backward runs its pairs of chunks through it too."""
    n_heads, n_q, n_k = q_lse.shape[0], q_lse.shape[1], k.shape[1]
    group = n_heads // k.shape[0]  # query head h reads kv head h // G
    c = heads_per_item(plan, n_heads, n_q, n_k)
    ordered_dq = OrderedDq(
        dq.reshape(n_heads // c, c, n_q, dq.shape[2]),
        p_sums.reshape(n_heads // c, c, n_q),
        plan.tile_mask,
        n_k,
        plan.block_q,
        plan.block_k,
    )

    def run(item: tuple[int, int]) -> None:
        k_start, g = item  # key block k_start of query heads g·c .. g·c + c - 1
        cols, its = slice(k_start, min(k_start + plan.block_k, n_k)), item_heads(g, c, hq, group)
        tiles = plan.tile_mask.column_tiles(cols.start, cols.stop, n_q, plan.block_q, its.heads)
        mods = TileMods(plan.tile_mask.mask_mod, plan.score_mod, its.b, its.h, diagonal_of(plan.tile_mask))
        param_rows = None if param_grads is None else param_grads[g, k_start // plan.block_k, ...]
        hs, kv = its.rows, its.kv
        key_block_grads(
            q_lse[hs],
            k[kv, cols],
            v[kv, cols],
            do_d[hs],
            lse[hs],
            mods,
            tiles,
            partial(ordered_dq.add, g, heads=its.heads),
            dk_heads[hs, cols],
            dv_heads[hs, cols],
            param_rows,
        )
        ordered_dq.finish(g, k_start)

    # the items, key block by key block: an item only waits (in ordered_dq) for one taken before it
    items = ((k_start, g) for k_start in range(0, n_k, plan.block_k) for g in range(n_heads // c))
    with one_blas_thread():
        run_items(run, items, plan.workers, on_failure=ordered_dq.fail)


class ItemHeads(NamedTuple):
    """The c query heads of backward item group g: their rows of the (B·Hq, ...) arrays, as (batch entry,
    query head) pairs, b and h as a mod takes them (numbers for one head, (c, 1, 1) arrays that broadcast
    against a tile of c heads), and the kv head each reads: a slice when G = 1 (K_j and V_j are views then),
    else an index array (a gather: copies)."""

    rows: slice
    heads: Heads
    b: Any
    h: Any
    kv: Any


def item_heads(g: int, c: int, hq: int, group: int) -> ItemHeads:
    """The ItemHeads of group g of c heads, hq query heads per batch entry, G = group query heads per kv
    head."""
    rows = slice(g * c, g * c + c)
    flat = np.arange(rows.start, rows.stop)  # (c,) their (batch entry, query head) pairs, flat
    heads = Heads(flat // hq, flat % hq)
    b, h = (heads.b.reshape(c, 1, 1), heads.h.reshape(c, 1, 1)) if c > 1 else (g // hq, g % hq)
    return ItemHeads(rows, heads, b, h, rows if group == 1 else flat // group)


def call_heads(dims: QKVShape, plan: BackwardPlan) -> int:
    """heads_per_item for a checked call's shapes."""
    return heads_per_item(plan, math.prod(dims.batch) * dims.hq, dims.n_q, dims.n_k)


def heads_per_item(plan: BackwardPlan, n_heads: int, n_q: int, n_k: int) -> int:
    """How many query heads a backward item takes at once, c: 1 where the heads' tiles may differ (a block
    mask) or a score_mod runs; for a Band, _tuning.backward_heads_per_item's rule. Any c gives the same bits
    (each head's sums are the same, in the same order)."""
    if plan.tile_mask.per_head or plan.score_mod is not None:
        return 1
    return band_heads_per_item(n_heads, n_q, n_k, plan.block_q, plan.block_k, plan.workers, _tuning.tile_rule())


@functools.lru_cache(maxsize=256)
def band_heads_per_item(
    n_heads: int, n_q: int, n_k: int, block_q: int, block_k: int, workers: int, rule: TileRule
) -> int:
    """backward_heads_per_item, worked out once for each shape, tiles, workers and tile rule in force (`rule`,
    which it reads for itself: here it is the key): every layer of a model asks the same at every step."""
    return backward_heads_per_item(n_heads, n_q, n_k, block_q, block_k, workers)


def key_block_grads(
    q_lse: np.ndarray,
    k_j: np.ndarray,
    v_j: np.ndarray,
    do_d: np.ndarray,
    lse: np.ndarray,
    mods: TileMods,
    tiles: Any,
    add_dq: Any,
    dk_rows: np.ndarray,
    dv_rows: np.ndarray,
    param_rows: np.ndarray | None = None,
) -> None:
    """Algorithm 2's inner loop for one key block j over the query blocks i that see it (tiles), for c heads
    at once that share those tiles: adds into dk_rows (c, bk, E) and dv_rows (c, bk, Ev), and hands each
    tile's share of dq, dS K_j (c, bq, E), and of P's row sums (c, bq) to add_dq (dq unscaled: the caller
    multiplies dq by the scale once). q_lse (c, L, E + 1) and do_d (c, L, Ev + 1) are query_rows': q times
    the scale beside −L (0 with a score_mod), dO beside −D = −rowsum(dO ∘ O); k_j (c, bk, E) and v_j
    (c, bk, Ev) the key block's keys and values; lse (c, L) with +inf for rows that see no key. mods: the
    tile's score_mod and mask_mod, as in the forward, with b and h broadcasting against a (c, bq, bk) tile;
    param_rows: where the learned score_mod's parameter gradient of this head and key block adds up (None:
    nothing learned; c is 1 then).

    Why this is fast: a tile's two subtractions ride in its matmuls as one more term of each dot product,
        S − L_i = [Q_i, −L_i] [K_j, 1]ᵀ        dP − D_i = [dO_i, −D_i] [V_j, 1]ᵀ
    (a 65th column costs a 64-column matmul about 2%, a pass over the tile much more), and P's row sums
    are the matrix-vector product P 1. A score_mod needs S itself, so with one, S − L_i comes after it.
    The rows [Q_i, −L_i] and [dO_i, −D_i] are slices of q_lse and do_d, made once for every key block;
    [K_j, 1]ᵀ and [V_j, 1]ᵀ, and the tiles P and dS (and S for a score_mod), once for this block's tiles.
    Heads that share their tiles go c to an item: fewer, larger matmuls, each worth more of the Python
    around it.
    """
    tiles = iter(tiles)
    first = next(tiles, None)
    if first is None:
        return
    (c, bk, _), dtype = k_j.shape, q_lse.dtype
    height = first.q_stop - first.q_start  # the widest tile: the first (a column's last may be shorter)
    k_one_t = ones_row_below(k_j)  # [K_j, 1]ᵀ (c, E + 1, bk)
    v_one_t = ones_row_below(v_j)  # [V_j, 1]ᵀ (c, Ev + 1, bk)
    p_buf, ds_buf, *raw_buf = np.empty((2 if mods.score_mod is None else 3, c * height * bk), dtype)
    ones = np.ones(bk, dtype)  # (bk,) P 1: P's row sums
    for t in itertools.chain([first], tiles):
        rows, bq = slice(t.q_start, t.q_stop), t.q_stop - t.q_start
        p, ds, *raw = (buffer[: c * bq * bk].reshape(c, bq, bk) for buffer in (p_buf, ds_buf, *raw_buf))
        q_idx, kv_idx = np.arange(t.q_start, t.q_stop)[:, None], np.arange(t.k_start, t.k_stop)
        # 1) scores of this tile less the forward's logsumexp, S − L_i (the scale is folded into q); with
        #    a score_mod, S first (q_lse's column is 0 then), kept raw for its derivative, L_i taken off after
        np.matmul(q_lse[:, rows], k_one_t, out=p)  # (c, bq, E + 1) @ (c, E + 1, bk)
        if raw:
            np.copyto(raw[0], p)
        # 2) S' = score_mod(S), -inf where the mask_mod hides a key; P = exp(S' − L_i): the forward's
        #    probabilities, exactly normalised, without a row max or sum (a hidden key: exp(-inf) = 0)
        apply_mods(p, t, mods, q_idx, kv_idx, keys_down=False)
        if raw:
            p -= lse[:, rows, None]
        np.exp(p, out=p)  # (c, bq, bk) P
        # 3) dV_j += Pᵀ dO_i
        dv_rows += p.transpose(0, 2, 1) @ do_d[:, rows, :-1]  # (c, bk, bq) @ (c, bq, Ev)
        # 4) dP − D_i = dO_i V_jᵀ − D_i in one matmul, then dS' = P ∘ (dP − D_i), in place; through the
        #    score_mod: dS = dS' ∘ ∂S'/∂S
        np.matmul(do_d[:, rows], v_one_t, out=ds)  # (c, bq, Ev + 1) @ (c, Ev + 1, bk): dP − D_i
        ds *= p  # (c, bq, bk) dS'
        if raw:
            through_score_mod(ds, raw[0], mods, q_idx, kv_idx, param_rows)
        # 5) dQ_i += dS K_j (in key-block order, with P's row sums: OrderedDq), dK_j += dSᵀ (scale · Q_i)
        add_dq(t, ds @ k_j, p @ ones)  # (c, bq, bk) @ (c, bk, E), (c, bq, bk) @ (bk,)
        dk_rows += ds.transpose(0, 2, 1) @ q_lse[:, rows, :-1]  # (c, bk, bq) @ (c, bq, E)


def ones_row_below(x: np.ndarray) -> np.ndarray:
    """[x, 1]ᵀ: x (c, n, m) transposed, with a row of ones below -> (c, m + 1, n), stored as it is read. A
    transposed view would do for the matmul, but OpenBLAS multiplies by a right operand stored transposed more
    slowly than by one stored row by row (python scripts/tiles.py --profile shows the backward's matmuls)."""
    c, n, m = x.shape
    out = np.empty((c, m + 1, n), x.dtype)
    out[:, :m] = x.transpose(0, 2, 1)
    out[:, m] = 1.0
    return out


def through_score_mod(
    ds: np.ndarray, s: np.ndarray, mods: TileMods, q_idx: Any, kv_idx: Any, param_rows: np.ndarray | None
) -> None:
    """The chain rule through S' = score_mod(S) on one tile (mod_grads.py derives it), in place: ds holds
    dS' = ∂loss/∂S' and becomes dS = dS' ∘ ∂S'/∂S (derivative None: 1, a bias). Learned parameters first take
    their share of dS' (param_grad) into param_rows."""
    if param_rows is not None:
        param_rows += mods.score_mod.param_grad(ds, mods.b, mods.h, q_idx, kv_idx)
    derivative = derivative_of(mods.score_mod, s, mods.b, mods.h, q_idx, kv_idx)  # numbers of s's shape
    if derivative is not None:
        ds *= derivative


class OrderedDq:
    """dq (n, c, L, E) and P's row sums (n, c, L), into which the key blocks of each of n groups of c heads (a
    backward item's heads) add their shares in key-block order, whatever the threads' timing: a wavefront.

    Key block j adds its share to the rows of query block i only once every earlier key block that sees
    query block i has added its own. Each row is then the sum over j = 0, 1, ... in that order, on any
    number of workers: the same bits as one thread, with neither an atomic add (a GPU's answer, whose
    order, and so last bits, would depend on the timing) nor a copy of dq per key block. A tile's place
    in that order is how many tiles of its row come before it (the mask's place(): for the causal band,
    its distance from the first key block the row sees): no table of tiles. The bookkeeping is one count
    per (group, query block), and per group how many of its key blocks have finished, from the first on.

    Every wait ends. A tile waits only for tiles of earlier key blocks of its group, and those items were
    taken before it (run_items takes them in order): they add their share, raise (then fail() wakes
    every waiter, which stops), or finish without reaching this tile's turn. In the last case the turn
    can never come (a mask whose column tiles or places disagree with its rows), and the tile raises a
    RuntimeError instead of waiting.
    """

    def __init__(
        self, dq: np.ndarray, p_sums: np.ndarray, tile_mask: TileMask, n_k: int, block_q: int, block_k: int
    ) -> None:
        self.dq, self.p_sums, self.tile_mask, self.n_k = dq, p_sums, tile_mask, n_k
        self.block_q, self.block_k = block_q, block_k
        self.added = np.zeros((dq.shape[0], -(-dq.shape[2] // block_q)), np.int64)  # key blocks added so far
        self.finished = np.zeros((dq.shape[0], -(-n_k // block_k) + 1), bool)  # (groups, key blocks + 1)
        self.done = np.zeros(dq.shape[0], np.int64)  # per group: key blocks 0 .. done - 1 have all finished
        self.turn = threading.Condition()
        self.failed = False

    def add(
        self,
        h: int,
        t: TileLike,
        share: np.ndarray,
        p_sum: np.ndarray,
        heads: Heads | None = None,
    ) -> None:
        """dq[h, :, t's rows] += share (c, bq, E) and p_sums[h, :, t's rows] += p_sum (c, bq), once it is t's
        turn. heads: group h's heads as (batch entry, query head), for a mask whose tiles differ between
        heads (one head a group then)."""
        place, block = self.tile_mask.place(t, self.n_k, self.block_k, heads), t.q_start // self.block_q
        holding(self.turn, self._add_in_turn, h, t, block, place, share, p_sum)

    def _add_in_turn(
        self,
        h: int,
        t: TileLike,
        block: int,
        place: int,
        share: np.ndarray,
        p_sum: np.ndarray,
    ) -> None:
        """add, under the turn's lock (taken through holding: a Ctrl-C at any bytecode never leaves it held,
        which would make every other worker wait for it forever)."""
        key_block = t.k_start // self.block_k
        # its turn, or every earlier key block of the group has finished: then the turn has come or never will
        self.turn.wait_for(lambda: self.failed or self.added[h, block] == place or self.done[h] >= key_block)
        if self.failed:  # another item raised: stop instead of waiting for a turn that never comes
            raise Stopped
        if self.added[h, block] != place:
            raise RuntimeError(
                f"the tiles of query block {block} of head {h} are out of order: key block {key_block} is "
                f"tile {place} of its row, but the key blocks before it, all finished, added "
                f"{self.added[h, block]} tiles; the mask's column tiles and places disagree with its rows"
            )
        self.dq[h, :, t.q_start : t.q_stop] += share
        self.p_sums[h, :, t.q_start : t.q_stop] += p_sum
        self.added[h, block] = place + 1
        self.turn.notify_all()

    def finish(self, h: int, k_start: int) -> None:
        """Key block k_start of group h has added all its tiles: wake the tiles that wait on it."""
        holding(self.turn, self._finish, h, k_start // self.block_k)

    def _finish(self, h: int, key_block: int) -> None:
        self.finished[h, key_block] = True
        while self.finished[h, self.done[h]]:  # the last column stays False: done stops at the key blocks
            self.done[h] += 1
        self.turn.notify_all()

    def fail(self) -> None:
        holding(self.turn, self._fail)

    def _fail(self) -> None:
        self.failed = True
        self.turn.notify_all()


def sink_grads(
    p_sums: np.ndarray,
    lse: np.ndarray,
    d: np.ndarray,
    dims: QKVShape,
    sinks: np.ndarray | None,
) -> Any:
    """dsink_h = -Σ_i P_sink,i D_i over the rows of head h in every batch entry, P_sink,i = exp(sink_h -
    lse_i), the weight the sink took in row i; that weight is added to P's row sums (B·Hq, L), which then sum
    to 1."""
    if sinks is None:
        return None
    p_sink = np.exp(np.tile(sinks, len(p_sums) // dims.hq)[:, None] - lse)  # (B·Hq, L)
    p_sums += p_sink
    return -(p_sink * d).reshape(-1, dims.hq, dims.n_q).sum(axis=(0, 2))  # (Hq,)


def check_weights_sum_to_one(p_sums: np.ndarray, lse: np.ndarray) -> None:
    """Each row of P = exp(S − lse) sums to 1 when lse is the forward's, for the same q, k, mask and scale.
    Refuse a backward handed another forward's state (a window or mask it did not get, another scale)
    instead of returning the gradients of some other function. Not checked: rows that saw no key (lse +inf
    here, P 0), NaN rows (they stay NaN in the gradients), and rows whose scores are so large that the
    forward and the backward, summing S's products in another order, may round S apart by more than the
    tolerance (|S|·10·eps: |lse| past 2,900 in float32, 6.7e7 in float64)."""
    eps = float(np.finfo(p_sums.dtype).eps)
    tolerance = 10 * np.sqrt(eps)  # 3.5e-3 in float32, 1.5e-7 in float64
    checkable = np.isfinite(p_sums) & (np.abs(lse) < tolerance / (10 * eps))  # (B·Hq, L); lse +inf fails too
    wrong = checkable & (np.abs(p_sums - 1) > tolerance)
    if wrong.any():
        head, row = np.argwhere(wrong)[0]
        raise ValueError(
            f"lse does not match q, k and the mask: the weights P = exp(S − lse) of row {row} of head {head} "
            f"sum to {p_sums[head, row]:.6g}, not 1. Pass the causal, window, align, scale (and block_mask, "
            "score_mod, sinks) the forward used, with its own out and lse "
            "(flash_attention(..., return_lse=True))"
        )
