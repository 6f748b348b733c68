"""Sparse attention (sparse.py): the indexer's plain and blockwise top-k equal and their ties to the earlier key,
the top-k merge associative, the attention over chosen keys against SciPy's softmax under the equivalent mask,
its backward by central differences, a decode step over arrays and its engine through a cache's pages, and bad
input refused with the argument named. The DSA layer built of them: tests/test_dsa.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gold_attention
from test_backward import FD_TOL, numerical_grad  # central differences, one entry at a time

from tinyattn_np import AttentionMemoryError, index_topk, sparse_attention
from tinyattn_np import _guard as guard_module
from tinyattn_np._paged_kernel import Pages
from tinyattn_np._sparse_decode import decode_chosen_pages, pool_blocks, topk_over_pages
from tinyattn_np._sparse_kernel import SparseInputs, attend_chosen, keep_topk
from tinyattn_np.measure import traced_peak
from tinyattn_np.sparse import (
    index_scores,
    index_topk_plain,
    merge_topk,
    sparse_attention_backward,
    sparse_attention_one_head,
    sparse_decode,
)


def indexer_inputs(rng, B=2, H=3, T=37, S=None, d=8, integers=False):
    """q_index (B, H, T, d), k_index (B, S, d), weights (B, T, H): normal, or small integers (exact sums, many ties)."""
    S = T if S is None else S
    if integers:
        return (
            rng.integers(-2, 3, (B, H, T, d)).astype(float),
            rng.integers(-2, 3, (B, S, d)).astype(float),
            rng.integers(-1, 3, (B, T, H)).astype(float),
        )
    return rng.standard_normal((B, H, T, d)), rng.standard_normal((B, S, d)), rng.standard_normal((B, T, H))


def gold_topk(q_index, k_index, weights, topk, causal=True):
    """The indexer's choice from its definition, with loops: each score as a sum over the heads, each row's keys
    sorted by (score descending, key ascending), the first topk listed in key order, -1 after."""
    B, H, T, _ = q_index.shape
    S = k_index.shape[1]
    chosen = np.full((B, T, topk), -1)
    for b in range(B):
        for t in range(T):
            seen = [s for s in range(S) if not causal or s <= t + S - T]
            score = {
                s: sum(weights[b, t, h] * max(q_index[b, h, t] @ k_index[b, s], 0) for h in range(H)) for s in seen
            }
            best = sorted(seen, key=lambda s: (-score[s], s))[:topk]
            chosen[b, t, : len(best)] = sorted(best)
    return chosen


def listed_mask(indices, S):
    """The boolean mask (B, 1, T, S) that keeps the keys each row lists."""
    B, T, _ = indices.shape
    mask = np.zeros((B, 1, T, S), bool)
    b, t, j = np.nonzero(indices >= 0)
    mask[b, 0, t, indices[b, t, j]] = True
    return mask


def random_indices(rng, B, T, S, n, empty=0.0):
    """n distinct keys of S for each query (all S and -1 after where n > S), a share `empty` of them -1."""
    indices = np.full((B, T, n), -1)
    for b in range(B):
        for t in range(T):
            keys = rng.permutation(S)[:n]
            indices[b, t, : len(keys)] = keys
    indices[rng.random(indices.shape) < empty] = -1
    return indices


# --- the indexer ------------------------------------------------------------------------------------


CASES = [(13, 13, 4, True), (9, 14, 5, True), (1, 10, 3, True), (6, 8, 20, True), (7, 9, 4, False), (5, 3, 2, True)]


@pytest.mark.parametrize("integers", [False, True], ids=["normal", "small integers: ties"])
@pytest.mark.parametrize(("T", "S", "topk", "causal"), CASES)
def test_the_plain_and_blockwise_indexer_equal_the_definition(rng, integers, T, S, topk, causal):
    q, k, w = indexer_inputs(rng, B=2, H=3, T=T, S=S, integers=integers)
    gold = gold_topk(q, k, w, topk, causal)
    np.testing.assert_array_equal(index_topk_plain(q, k, w, topk, causal=causal), gold)
    for block_q, block_k in [(1, 1), (4, 3), (64, 1024)]:
        got = index_topk(q, k, w, topk, causal=causal, block_q=block_q, block_k=block_k, workers=2)
        np.testing.assert_array_equal(got, gold, err_msg=f"blocks {block_q} x {block_k}")


def test_a_tie_goes_to_the_earlier_key():
    q, w = np.ones((1, 1, 1, 1)), np.ones((1, 1, 1))
    k = np.array([[[2.0], [5.0], [2.0], [5.0], [2.0]]])  # keys 1 and 3 tie at 5, keys 0, 2 and 4 at 2
    for chosen in (index_topk_plain(q, k, w, 3), index_topk(q, k, w, 3, block_k=1)):
        np.testing.assert_array_equal(chosen, [[[0, 1, 3]]])


def test_a_query_with_fewer_keys_than_topk_chooses_them_all(rng):
    q, k, w = indexer_inputs(rng, B=1, H=2, T=10, d=4)
    chosen = index_topk(q, k, w, 6)
    for t in range(10):
        assert sorted(chosen[0, t, : min(t + 1, 6)]) == sorted(gold_topk(q, k, w, 6)[0, t, : min(t + 1, 6)])
        assert np.all(chosen[0, t, min(t + 1, 6) :] == -1) and np.all(chosen[0, t, : min(t + 1, 6)] >= 0)


def test_the_scores_are_the_formula(rng):
    q, k, w = indexer_inputs(rng, B=1, H=2, T=5, S=7, d=3)
    scores = index_scores(q, k, w, causal=True)
    for t in range(5):
        for s in range(7):
            gold = sum(w[0, t, h] * max(q[0, h, t] @ k[0, s], 0) for h in range(2)) if s <= t + 2 else -np.inf
            assert scores[0, t, s] == pytest.approx(gold, rel=1e-12, abs=1e-12)


def test_float32_indexer_blockwise_equals_plain(rng):
    q, k, w = (x.astype(np.float32) for x in indexer_inputs(rng, B=1, H=4, T=200, d=16))
    np.testing.assert_array_equal(index_topk(q, k, w, 16, block_q=32, block_k=40), index_topk_plain(q, k, w, 16))


def test_the_blockwise_indexer_never_holds_the_scores():
    rng = np.random.default_rng(0)
    q, k, w = (x.astype(np.float32) for x in indexer_inputs(rng, B=1, H=2, T=2048, d=8))
    index_topk(q, k, w, 32, workers=1)  # warm
    _, peak = traced_peak(index_topk, q, k, w, 32, workers=1)
    assert peak < 2048 * 2048 * 4 / 4, f"{peak:,} bytes: a quarter of the T x T float32 scores"


# --- the merge of two top-k lists --------------------------------------------------------------------


def random_list(rng, keys, k):
    """A top-k list of the given keys: scores from a few values (ties), the best k in merge_topk's order."""
    scores = rng.integers(0, 4, len(keys)).astype(float)
    order = sorted(range(len(keys)), key=lambda i: (-scores[i], keys[i]))[:k]
    pad = k - len(order)
    return np.r_[scores[order], [-np.inf] * pad], np.r_[np.asarray(keys)[order], [-1] * pad].astype(np.int64)


def test_the_merge_is_the_topk_of_the_union_and_associative():
    rng = np.random.default_rng(5)
    for _ in range(50):
        k = int(rng.integers(1, 6))
        keys = rng.permutation(30)
        a, b, c = (random_list(rng, part, k) for part in np.split(keys[: 3 * 6], 3))
        left, right = merge_topk(*merge_topk(*a, *b), *c), merge_topk(*a, *merge_topk(*b, *c))
        for x, y in zip(left, right, strict=True):
            np.testing.assert_array_equal(x, y)
        ab, ba = merge_topk(*a, *b), merge_topk(*b, *a)  # and commutative
        np.testing.assert_array_equal(ab[1], ba[1])
        every = np.r_[a[0], b[0], c[0]], np.r_[a[1], b[1], c[1]]  # the top-k of the union, sorted from scratch
        order = sorted((i for i in range(len(every[1])) if every[1][i] >= 0), key=lambda i: (-every[0][i], every[1][i]))
        union = every[1][order][:k]
        np.testing.assert_array_equal(left[1][: len(union)], union)


def test_the_engines_merge_keeps_the_same_set_as_merge_topk():
    rng = np.random.default_rng(6)
    for _ in range(50):
        k, n = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        kept = random_list(rng, list(range(int(rng.integers(0, 10)))), k)  # keys before every new key
        scores, new_keys = rng.integers(0, 4, (1, n)).astype(float), np.arange(10, 10 + n)
        in_key_order = np.argsort(kept[1], kind="stable")  # the engine keeps its list in key order, -1 first
        fast = keep_topk(kept[0][None, in_key_order], kept[1][None, in_key_order], scores, new_keys)
        assert list(fast[1][0]) == sorted(fast[1][0])  # still in key order
        plain = merge_topk(kept[0], kept[1], scores[0], new_keys)
        assert set(fast[1][0][fast[0][0] > -np.inf]) == set(plain[1][plain[0] > -np.inf])


# --- attention over the chosen keys -----------------------------------------------------------------

SHAPES = {  # (B, H, Hkv, T, S, E, Ev, n)
    "MHA": (2, 3, 3, 9, 11, 6, 6, 4),
    "GQA, E != Ev": (2, 4, 2, 7, 12, 5, 3, 5),
    "MQA, n > S": (1, 4, 1, 6, 5, 4, 7, 9),
    "T = 1": (2, 2, 1, 1, 16, 8, 8, 6),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sparse_attention_is_attention_under_the_mask_that_keeps_the_listed_keys(rng, shape, dtype):
    B, H, Hkv, T, S, E, Ev, n = SHAPES[shape]
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, H, T, E), (B, Hkv, S, E), (B, Hkv, S, Ev)))
    indices = random_indices(rng, B, T, S, n, empty=0.2)
    indices[0, 0] = -1  # a query with no key: 0 and -inf
    out, lse = sparse_attention(q, k, v, indices, return_lse=True)
    gold, gold_lse = gold_attention(q, k, v, listed_mask(indices, S))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, gold, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, gold_lse, rtol=tol, atol=tol)
    assert np.all(out[0, :, 0] == 0) and np.all(lse[0, :, 0] == -np.inf)
    for head in range(H):  # the plain form, head by head
        one, one_lse = sparse_attention_one_head(
            q[-1, head], k[-1, head * Hkv // H], v[-1, head * Hkv // H], indices[-1], block_k=2
        )
        np.testing.assert_allclose(one, out[-1, head], rtol=tol, atol=tol)
        np.testing.assert_allclose(one_lse, lse[-1, head], rtol=tol, atol=tol)


def test_blocks_of_the_list_workers_and_values_in_the_keys_give_the_same_result(rng):
    q, latent = rng.standard_normal((2, 4, 10, 9)), rng.standard_normal((2, 1, 20, 9))
    indices = random_indices(rng, 2, 10, 20, 12, empty=0.1)
    view, copy = latent[..., :7], latent[..., :7].copy()  # the values: the keys' first 7 numbers
    whole = sparse_attention(q, latent, copy, indices)
    np.testing.assert_array_equal(sparse_attention(q, latent, view, indices), whole)  # read from the gathered keys
    np.testing.assert_array_equal(sparse_attention(q, latent, view, indices, workers=3), whole)
    inputs = SparseInputs(q, latent, view, indices, 1 / 3)
    blocks = attend_chosen(inputs, gathered_bytes=4 * 9 * 8)  # 4 keys a step: the online softmax over 3 blocks
    np.testing.assert_allclose(blocks[0], whole, rtol=1e-13, atol=1e-13)


def test_scores_past_exps_range_take_the_running_max(rng):
    q, k, v = (
        rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
        rng.standard_normal((1, 1, 9, 8)).astype(np.float32),
        rng.standard_normal((1, 1, 9, 3)).astype(np.float32),
    )
    indices = random_indices(rng, 1, 4, 9, 5)
    out, lse = sparse_attention(q, k, v, indices, scale=200.0, return_lse=True)  # exp(s) of float32 overflows
    gold, gold_lse = gold_attention(q, k, v, listed_mask(indices, 9), scale=200.0)
    np.testing.assert_allclose(out, gold, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-5)


def test_float16_is_computed_in_float32_and_cast_back(rng):
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float16) for _ in range(3))
    indices = random_indices(rng, 1, 5, 5, 3)
    out = sparse_attention(q, k, v, indices)
    gold = sparse_attention(*(x.astype(np.float32) for x in (q, k, v)), indices)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, gold.astype(np.float16))


def test_a_key_listed_twice_counts_twice(rng):
    q, k, v = rng.standard_normal((1, 1, 1, 4)), rng.standard_normal((1, 1, 6, 4)), rng.standard_normal((1, 1, 6, 3))
    indices = np.array([[[2, 5, 2]]])
    gathered = k[:, :, [2, 5, 2]], v[:, :, [2, 5, 2]]  # the three listed keys as a dense sequence
    np.testing.assert_allclose(sparse_attention(q, k, v, indices), gold_attention(q, *gathered)[0], rtol=1e-12)


@pytest.mark.parametrize("shape", ["GQA, E != Ev", "MQA, n > S"])
def test_the_backward_is_central_differences(rng, shape):
    B, H, Hkv, T, S, E, Ev, n = SHAPES[shape]
    q, k, v = (rng.standard_normal(shape) for shape in ((B, H, T, E), (B, Hkv, S, E), (B, Hkv, S, Ev)))
    indices = random_indices(rng, B, T, S, n, empty=0.2)
    indices[0, 1, :2] = [3, 3]  # a key listed twice in one row: its terms add twice
    dout = rng.standard_normal((B, H, T, Ev))
    out, lse = sparse_attention(q, k, v, indices, return_lse=True, scale=0.4)
    grads = sparse_attention_backward(q, k, v, indices, out, dout, lse, scale=0.4)
    for x, grad, name in zip((q, k, v), grads, "qkv", strict=True):
        gold = numerical_grad(lambda: float(np.sum(sparse_attention(q, k, v, indices, scale=0.4) * dout)), x)
        np.testing.assert_allclose(grad, gold, rtol=0, atol=FD_TOL, err_msg=f"d{name}")
    unlisted = np.setdiff1d(np.arange(S), indices[0])  # a key no query of batch entry 0 chose gets 0
    assert np.all(grads[1][0][:, unlisted] == 0)


# --- bad input ---------------------------------------------------------------------------------------


def test_bad_indices_are_refused_with_the_argument_named(rng):
    q, k, v = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 1, 6, 3)), rng.standard_normal((1, 1, 6, 3))
    good = random_indices(rng, 1, 4, 6, 2)
    out_of_range = good.copy()
    out_of_range[0, 2, 1] = 6  # S = 6: one past the last key
    cases = [
        (ValueError, out_of_range, r"indices must lie in \[0, 6\).*got 6 at \(0, 2, 1\)"),
        (ValueError, np.full((1, 4, 2), -2), r"indices must lie in \[0, 6\).* or be -1.*got -2"),
        (ValueError, good[0], r"indices must be \(B, T, topk\) = \(1, 4, topk >= 1\); got \(4, 2\)"),
        (ValueError, good[:, :3], r"got \(1, 3, 2\)"),
        (ValueError, good[..., :0], r"topk >= 1"),
        (TypeError, good.astype(float), "indices must be an integer ndarray"),
        (TypeError, good.tolist(), "indices must be an integer ndarray"),
    ]
    for error, indices, message in cases:
        with pytest.raises(error, match=message):
            sparse_attention(q, k, v, indices)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        sparse_attention(q[:, :1], np.concatenate([k, k], axis=1), np.concatenate([v, v], axis=1), good)
    out, lse = sparse_attention(q, k, v, good, return_lse=True)
    with pytest.raises(ValueError, match="out and dout must be"):
        sparse_attention_backward(q, k, v, good, out, out[..., :2], lse)


def test_bad_indexer_input_is_refused_with_the_argument_named(rng):
    q, k, w = indexer_inputs(rng, B=1, H=2, T=4, d=3)
    for topk, error in [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)]:
        with pytest.raises(error, match="topk must be a positive int"):
            index_topk(q, k, w, topk)
    with pytest.raises(TypeError, match="causal must be True or False"):
        index_topk(q, k, w, 2, causal="yes")
    with pytest.raises(ValueError, match=r"q_index must be \(B, H_I, T, d_I\)"):
        index_topk(q[0], k, w, 2)
    with pytest.raises(ValueError, match=r"k_index must be \(B, S, d_I\) = \(1, S, 3\)"):
        index_topk(q, k[..., :2], w, 2)
    with pytest.raises(ValueError, match=r"weights must be \(B, T, H_I\) = \(1, 4, 2\)"):
        index_topk(q, k, w[..., :1], 2)
    with pytest.raises(TypeError, match="k_index must be float16, float32 or float64"):
        index_topk(q, k.astype(int), w, 2)
    w[0, 2, 1] = np.nan  # a NaN score is neither above nor below the others
    with pytest.raises(ValueError, match=r"weights must be finite; it holds NaN or inf at \(0, 2, 1\)"):
        index_topk(q, k, w, 2)


def test_a_nan_stays_nan_and_a_query_with_no_key_gets_zero(rng):
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 5, 4))
    q[0, 1, 2, 0] = np.nan
    indices = np.array([[[0, 1], [-1, -1], [2, 4]]])
    out, lse = sparse_attention(q, k, v, indices, return_lse=True)
    assert np.isnan(out[0, 1, 2]).all() and np.isnan(lse[0, 1, 2])  # the running max's answer too, never a quiet 0
    assert np.all(out[0, :, 1] == 0) and np.all(lse[0, :, 1] == -np.inf)
    assert np.isfinite(out[0, 0]).all() and np.isfinite(out[0, 1, 0]).all()


def test_the_plain_scores_are_refused_before_they_are_allocated(rng, monkeypatch):
    monkeypatch.setattr(guard_module, "memory_usable", lambda: 2 * 10**7)
    q, k, w = indexer_inputs(rng, B=1, H=4, T=1000, d=2)  # the plain form's dots: 64 MB
    with pytest.raises(AttentionMemoryError, match="index_scores would allocate"):
        index_topk_plain(q, k, w, 4)
    index_topk(q, k, w, 4)  # the blockwise form holds a block of scores, not T x S


# --- decoding over arrays, and the engine through a cache's pages --------------------------------------


@pytest.mark.parametrize("block_k", [3, 5, 64])
def test_the_paged_step_equals_sparse_decode_over_the_gathered_sequences(rng, block_k):
    """decode_chosen_pages over a pool whose tables run through it in runs and single blocks, several sequences of
    different lengths, blocks of keys that end inside a block of the pool: sparse_decode over each sequence laid
    out as arrays, and the same chosen tokens."""
    H, r, d_rope, H_I, d_I, T, size = 4, 6, 2, 3, 5, 2, 4
    latent_dim = r + d_rope
    pool = rng.standard_normal((1, 12, size, latent_dim + d_I))  # (Hkv, num_blocks, block_size, E)
    tables, lengths = [(3, 4, 5, 0), (7,), (9, 1, 2, 10, 11)], [15, 2, 19]
    q_latent, q_index = rng.standard_normal((3, H, T, latent_dim)), rng.standard_normal((3, H_I, T, d_I))
    weights = rng.standard_normal((3, T, H_I))
    pages = Pages(pool, pool[..., :r], tables, lengths)
    chosen = topk_over_pages(q_index, weights, pool[0, ..., latent_dim:], pages, 6, block_k=block_k, workers=2)
    o, _ = decode_chosen_pages(
        q_latent, q_index, weights, pages, 6, latent_dim=latent_dim, value_dim=r, scale=0.3, workers=2
    )
    gathered = np.zeros((3, 20, latent_dim + d_I))
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        gathered[b, :n] = pool[0, list(table)].reshape(-1, latent_dim + d_I)[:n]
    gold_o, gold_chosen = sparse_decode(
        q_latent,
        q_index,
        weights,
        gathered[..., :latent_dim],
        gathered[..., latent_dim:],
        lengths,
        6,
        value_dim=r,
        scale=0.3,
    )
    np.testing.assert_array_equal(chosen, gold_chosen)
    np.testing.assert_allclose(o, gold_o, rtol=1e-13, atol=1e-14)
    for k0, pieces in pool_blocks(pool[0, ..., latent_dim:], tables[2], 19, block_k):  # views of the pool
        assert all(np.shares_memory(piece, pool) for piece in pieces) and k0 % block_k == 0


def test_sparse_decode_reads_each_sequence_at_its_own_length(rng):
    H, r, d_rope, H_I, d_I, L = 4, 6, 2, 2, 5, 2
    lengths = np.array([3, 9, 6])
    q_latent, q_index = rng.standard_normal((3, H, L, r + d_rope)), rng.standard_normal((3, H_I, L, d_I))
    weights = rng.standard_normal((3, L, H_I))
    latents, index_keys = rng.standard_normal((3, 10, r + d_rope)), rng.standard_normal((3, 10, d_I))
    o, chosen = sparse_decode(q_latent, q_index, weights, latents, index_keys, lengths, 4, value_dim=r)
    for b, n in enumerate(lengths):
        gold_chosen = gold_topk(q_index[b : b + 1], index_keys[b : b + 1, :n], weights[b : b + 1], 4)
        np.testing.assert_array_equal(chosen[b : b + 1], gold_chosen)
        latent = latents[b : b + 1, None, :n]
        gold, _ = gold_attention(q_latent[b : b + 1], latent, latent[..., :r], listed_mask(gold_chosen, n))
        np.testing.assert_allclose(o[b : b + 1], gold, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"lengths must be \(3,\) ints in \[2, 10\]"):
        sparse_decode(q_latent, q_index, weights, latents, index_keys, [1, 9, 6], 4, value_dim=r)
    with pytest.raises(ValueError, match=r"latents and index_keys must be \(B=3, max_tokens, ·\)"):
        sparse_decode(q_latent, q_index, weights, latents, index_keys[:, :9], lengths, 4, value_dim=r)
