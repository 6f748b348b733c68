"""tinyattn_np.sparse_profile: the timed copy of the indexer's running top-k gives the engine's indices, and
every part of a run is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np import index_topk
from tinyattn_np.profiler import PYTHON, products_ratio
from tinyattn_np.sparse_profile import INDEX_PARTS, profile_index


@pytest.mark.parametrize(
    ("queries", "keys", "topk"),
    [(70, 300, 16), (40, 1100, 8), (40, 40, 8), (5, 20, 32)],
    ids=["blocks past topk", "two merges", "a diagonal block", "every query sees at most topk"],
)
def test_the_indexers_copy_gives_the_engines_indices(queries, keys, topk) -> None:
    """index_topk's engine profiled part by part: the copy's indices are the engine's (and index_topk's), every
    part is named, and the FLOPs are 2 d_I a score of every head the engine computes (a block of 32 queries
    scores the keys its last query sees, and scores nothing where that query sees at most topk)."""
    rng = np.random.default_rng(3)
    heads, d = 3, 8
    q = rng.standard_normal((1, heads, queries, d)).astype(np.float32)
    k = rng.standard_normal((1, keys, d)).astype(np.float32)
    w = rng.standard_normal((1, queries, heads)).astype(np.float32)
    row = profile_index(q, k, w, topk, repeats=1, matmul_rate=lambda: 100.0)
    assert row["same_bits"] and row["matmul_gflops"] == 100.0
    assert tuple(row["parts_ms"]) == (*INDEX_PARTS, PYTHON) and all(ms >= 0 for ms in row["parts_ms"].values())
    blocks = [(min(32, queries - q0), min(q0 + 32, queries) + keys - queries) for q0 in range(0, queries, 32)]
    scored = sum(rows * seen for rows, seen in blocks if seen > topk)
    assert row["flops"] == 2 * d * heads * scored
    if scored:
        assert products_ratio(row) >= 1.0


def test_the_indexers_profile_refuses_what_index_topk_refuses() -> None:
    q, k, w = np.ones((1, 2, 4, 8), np.float32), np.ones((1, 4, 8), np.float32), np.ones((1, 4, 2), np.float32)
    with pytest.raises(ValueError, match="topk"):
        profile_index(q, k, w, 0, repeats=1, matmul_rate=lambda: 100.0)
    with pytest.raises(ValueError, match="topk"):
        index_topk(q, k, w, 0)
