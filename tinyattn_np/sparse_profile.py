"""Where DeepSeek's indexer spends its time: index_topk's engine (_sparse_kernel.running_topk) copied statement
for statement, each NumPy call timed into its part, on one thread and the blocks index_topk takes, as profiler.py
does for flash attention's kernels (its Stopwatch and measure_parts). The copy calls the engine's own helpers and
must give its bits. scripts/sparse.py prints it beside the speed checks: the scores' matmuls against their FLOPs
at the machine's matmul rate, and what each part after them adds.

    profile_index(q_index, k_index, weights, topk, repeats=3, matmul_rate=...)   -> its parts and FLOPs
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._sparse_kernel import (
    QUERY_BLOCK,
    SCORES_PER_TILE,
    check_index_inputs,
    keep_topk,
    keys_between_merges,
    order_topk,
    running_topk,
)
from .profiler import PARTS, measure_parts

__all__ = ["INDEX_PARTS", "profile_index"]

MATMULS, COPIES = PARTS[0], PARTS[-1]

RELU, WEIGHTED_SUM, TOPK = "ReLU", "the heads' weighted sum", "the running top-k"
INDEX_PARTS = (MATMULS, RELU, WEIGHTED_SUM, TOPK, COPIES)  # the order of the work on each tile of scores


def profile_index(
    q_index: np.ndarray,
    k_index: np.ndarray,
    weights: np.ndarray,
    topk: int,
    *,
    repeats: int,
    matmul_rate: Callable[[], float],
) -> dict[str, Any]:
    """index_topk's engine (causal, its default blocks) on one thread, split into INDEX_PARTS: the scores of
    every indexer head (matmuls), the ReLU, the heads' weighted sum, the running top-k (the diagonal's -inf, the
    merges and the final order), the copies. q_index (B, H_I, T, d_I), k_index (B, S, d_I), weights (B, T, H_I).
    flops: the matmuls' as the engine runs them, 2 d_I a score of every indexer head it computes."""
    inputs = check_index_inputs(q_index, k_index, weights, topk, True)
    block_k = keys_between_merges(inputs.topk)
    row = measure_parts(
        lambda: (running_topk(inputs, block_q=QUERY_BLOCK, block_k=block_k, workers=1),),
        lambda clock: (index_copy(inputs, block_k, clock),),
        repeats,
        matmul_rate,
        INDEX_PARTS,
    )
    (B, heads, T, d), S = inputs.q_index.shape, inputs.k_index.shape[1]
    blocks = [(min(QUERY_BLOCK, T - q0), min(q0 + QUERY_BLOCK, T) + S - T) for q0 in range(0, T, QUERY_BLOCK)]
    scored = sum(rows * seen for rows, seen in blocks if seen > topk)  # a block scores the keys its last row sees
    row.update(flops=2 * d * heads * B * scored, block_k=block_k)
    return row


def index_copy(inputs: Any, block_k: int, clock: Any) -> np.ndarray:
    """running_topk on one worker (causal), its blocks of queries in turn, topk_of_rows' statements each timed
    into its part (the scores: scores_copy) -> indices (B, T, topk), the engine's."""
    q_index, k_index, weights, topk, _ = inputs
    (B, _, T, _), S, topk_range = q_index.shape, k_index.shape[1], np.arange(topk)
    with clock(COPIES):
        indices = np.empty((B, T, topk), np.int64)
    for b, q0 in ((b, q0) for b in range(B) for q0 in range(0, T, QUERY_BLOCK)):
        rows = slice(q0, min(q0 + QUERY_BLOCK, T))
        last, R = np.arange(rows.start, rows.stop) + S - T, rows.stop - rows.start  # the last key each row sees
        if last[-1] + 1 <= topk:
            with clock(TOPK):
                indices[b, rows] = np.where(topk_range <= last[:, None], topk_range, -1)
            continue
        with clock(COPIES):
            q_rows = q_index[b, :, rows].swapaxes(0, 1).reshape(R * q_index.shape[1], -1)  # (R·H_I, d_I)
            kept, kept_keys = np.full((R, topk), -np.inf, q_index.dtype), np.full((R, topk), -1, np.int64)
        for k0 in range(0, int(last[-1]) + 1, block_k):
            scores = scores_copy(q_rows, k_index[b, k0 : min(k0 + block_k, int(last[-1]) + 1)], weights[b, rows], clock)
            k1 = k0 + scores.shape[1]
            with clock(TOPK):
                if k1 - 1 > last[0]:
                    for r in range(R):
                        scores[r, max(last[r] + 1 - k0, 0) :] = -np.inf
                kept, kept_keys = keep_topk(kept, kept_keys, scores, np.arange(k0, k1))
        with clock(TOPK):
            indices[b, rows] = order_topk(kept, kept_keys)
    return indices


def scores_copy(q_rows: np.ndarray, keys: np.ndarray, w: np.ndarray, clock: Any) -> np.ndarray:
    """block_scores of one piece of keys (n, d_I), each line timed into its part -> (R, n)."""
    R, H = w.shape
    with clock(COPIES):
        out = np.empty((R, len(keys)), q_rows.dtype)
    step = max(1, SCORES_PER_TILE // (R * H))
    for s0 in range(0, len(keys), step):
        with clock(MATMULS):
            dots = q_rows @ keys[s0 : s0 + step].T  # (R·H_I, keys)
        with clock(RELU):
            np.maximum(dots, 0, out=dots)
        with clock(WEIGHTED_SUM):
            summed = w[:, None, :] @ dots.reshape(R, H, -1)  # (R, 1, H_I) @ (R, H_I, keys)
        with clock(COPIES):
            out[:, s0 : s0 + dots.shape[1]] = summed[:, 0]
    return out
