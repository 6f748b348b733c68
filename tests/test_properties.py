"""Property-based tests (hypothesis): the identities the library rests on, for drawn sizes rather than
the few shapes someone thought of.

Each test draws sizes and an int seed; the values are np.random.default_rng(seed).standard_normal,
which is fast and bounded in practice. Profiles live in conftest.py: "ci" by default, and
`pytest --hypothesis-profile=thorough` for a long run. A shrunk failure prints its drawn arguments
(every size), and each assertion's message names them again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from conftest import assert_close, bottom_right, gold_attention
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinyattn_np import attention, causal_mask, flash_attention, merge_states, rope, softmax

DTYPES = st.sampled_from([np.float32, np.float64])
SEEDS = st.integers(0, 2**32 - 1)

# flash_attention runs one Python loop step per tile, so block size 1 at L = S = 300 would be 90,000
# steps a head (seconds). An example may run about this many tiles in all, over all its heads.
MAX_TILES = 2048


# --- flash_attention == attention ------------------------------------------------------------


@dataclass(frozen=True)
class FlashCase:
    """Every drawn size of one flash-vs-reference example; its repr is what a shrunk failure prints."""

    batch: tuple[int, ...]  # leading dims before the head axis, 0 to 2 of them
    hq: int  # query heads, a multiple of hkv
    hkv: int  # key/value heads
    n_q: int  # L
    n_k: int  # S
    e: int  # E, q and k's head dim
    ev: int  # Ev, v's head dim
    block_q: int
    block_k: int
    causal: bool
    window: int | None  # a sliding window (causal only): the last `window` keys of each query
    kv_heads_per_step: int  # kv heads in one batched tile step (any count gives the same result)
    two_d: bool  # q (L, E), k (S, E), v (S, Ev): one head and no head axis
    dtype: type
    seed: int

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        heads = () if self.two_d else (*self.batch, self.hq)
        kv_heads = () if self.two_d else (*self.batch, self.hkv)
        q = rng.standard_normal((*heads, self.n_q, self.e)).astype(self.dtype)  # (..., Hq, L, E)
        k = rng.standard_normal((*kv_heads, self.n_k, self.e)).astype(self.dtype)  # (..., Hkv, S, E)
        v = rng.standard_normal((*kv_heads, self.n_k, self.ev)).astype(self.dtype)  # (..., Hkv, S, Ev)
        return q, k, v


@st.composite
def flash_cases(draw: st.DrawFn) -> FlashCase:
    batch = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=2))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))  # GQA: every query head group the same size
    n_q, n_k = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    e, ev = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    two_d = batch == () and hq == 1 and draw(st.booleans())
    # at most `per_axis` blocks along L and along S, so that all heads together stay near MAX_TILES;
    # block sizes above L or S (one ragged block) and sizes that do not divide are both in range
    n_heads = math.prod(batch) * hq
    per_axis = max(2, math.isqrt(MAX_TILES // n_heads))
    block_q = draw(st.integers(-(-n_q // per_axis), 300))
    block_k = draw(st.integers(-(-n_k // per_axis), 300))
    causal = draw(st.booleans())
    window = draw(st.none() | st.integers(1, n_k + 2)) if causal else None
    per_step = draw(st.integers(1, math.prod(batch) * hkv))
    return FlashCase(
        batch, hq, hkv, n_q, n_k, e, ev, block_q, block_k, causal, window, per_step, two_d, draw(DTYPES), draw(SEEDS)
    )


@given(case=flash_cases())
def test_flash_attention_equals_attention(case):
    q, k, v = case.arrays()
    note(f"q {q.shape}, k {k.shape}, v {v.shape}, block_q={case.block_q}, block_k={case.block_k}")
    tiles = dict(block_q=case.block_q, block_k=case.block_k, kv_heads_per_step=case.kv_heads_per_step)
    out, lse = flash_attention(q, k, v, causal=case.causal, window=case.window, return_lse=True, **tiles)
    assert out.shape == (*q.shape[:-1], case.ev) and out.dtype == case.dtype, case
    # lse stays in the compute dtype: float32 for float16 inputs (float16 overflows past 65504)
    assert lse.shape == q.shape[:-1] and lse.dtype == np.result_type(case.dtype, np.float32), case
    # tolerance(dtype): both sum the same <= 300 products a row, in tiles or in one go; conftest's
    # bound is a few hundred ulps of such a sum
    reference = attention(q, k, v, causal=case.causal, window=case.window)
    assert_close(out, reference, case.dtype, f"flash vs attention, {case}")

    # lse against scipy's logsumexp of the scaled, bottom-right-masked scores (in float64)
    heads = (lambda x: x[None]) if case.two_d else (lambda x: x)
    allowed = bottom_right(case.n_q, case.n_k) if case.causal else None
    if case.window is not None:  # the band's back edge, written as a loop: query i sees j > i + S - L - window
        allowed = allowed & np.array(
            [[j > i + case.n_k - case.n_q - case.window for j in range(case.n_k)] for i in range(case.n_q)]
        ).reshape(case.n_q, case.n_k)
    gold_lse = gold_attention(heads(q), heads(k), heads(v), allowed)[1].reshape(lse.shape)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(gold_lse), err_msg=f"rows that see no key, {case}")
    finite = np.isfinite(gold_lse)
    # tolerance(dtype): lse is log of one such sum plus the row max, so the same bound holds
    assert_close(lse[finite], gold_lse[finite], case.dtype, f"lse vs scipy, {case}")


# --- merge_states -----------------------------------------------------------------------------


@given(
    hq=st.integers(1, 3),
    n_q=st.integers(1, 12),
    e=st.integers(1, 8),
    ev=st.integers(1, 8),
    which_part=hnp.arrays(np.int8, st.integers(0, 40), elements=st.integers(0, 2)),
    dtype=DTYPES,
    seed=SEEDS,
)
def test_merge_states_is_associative_and_commutative(hq, n_q, e, ev, which_part, dtype, seed):
    """Three partial attentions over disjoint key sets A, B, C (key j goes to set which_part[j]; a set
    may be empty, then its lse is -inf) merge to the same whole in any order and grouping."""
    sizes = f"Hq={hq}, L={n_q}, S={which_part.size}, E={e}, Ev={ev}, parts {which_part.tolist()}, {dtype.__name__}"
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((hq, n_q, e)).astype(dtype)  # (Hq, L, E)
    k = rng.standard_normal((hq, which_part.size, e)).astype(dtype)  # (Hq, S, E)
    v = rng.standard_normal((hq, which_part.size, ev)).astype(dtype)  # (Hq, S, Ev)
    a, b, c = (flash_attention(q, k[:, which_part == p], v[:, which_part == p], return_lse=True) for p in range(3))

    # tolerance(dtype): each merge rounds exp(lse_x - lse) and one weighted sum, a few ulps; two merges in
    # another order differ by a few tens of ulps at most, far inside conftest's bound
    def same(mine, gold, what):
        assert_close(mine[0], gold[0], dtype, f"{what} out, {sizes}")
        assert_close(mine[1], gold[1], dtype, f"{what} lse, {sizes}")

    same(merge_states(*a, *b), merge_states(*b, *a), "A+B vs B+A")
    same(merge_states(*merge_states(*a, *b), *c), merge_states(*a, *merge_states(*b, *c)), "(A+B)+C vs A+(B+C)")
    same(merge_states(*merge_states(*c, *a), *b), merge_states(*a, *merge_states(*b, *c)), "(C+A)+B vs A+(B+C)")
    # and the merge is the attention over all the keys: a sum of S products in another order
    same(merge_states(*merge_states(*a, *b), *c), flash_attention(q, k, v, return_lse=True), "merged vs whole")


# --- softmax ----------------------------------------------------------------------------------


@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=8),
    axis_index=st.integers(0, 2),
    shift=st.floats(0.0, 1e3),
    hidden_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    dtype=DTYPES,
    seed=SEEDS,
)
def test_softmax_is_invariant_to_a_constant_per_row(shape, axis_index, shift, hidden_fraction, dtype, seed):
    """softmax(x + c) == softmax(x) for c constant along the softmax axis (it cancels in the ratio),
    including entries at -inf (masked keys) and rows that are all -inf (zeros either way)."""
    axis = axis_index % len(shape)
    rng = np.random.default_rng(seed)
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    x[rng.random(shape) < hidden_fraction] = -np.inf  # masked keys; with 1.0 every row is masked
    c_shape = tuple(1 if i == axis else n for i, n in enumerate(shape))
    c = (shift * rng.uniform(-1, 1, c_shape)).astype(dtype)  # one constant a row, |c| <= shift
    note(f"x {shape}, axis={axis}, c {c_shape}, |c| <= {shift}, {dtype.__name__}")

    eps = np.finfo(dtype).eps
    largest = float(np.max(np.abs(x), initial=0.0, where=np.isfinite(x)))
    # x + c is rounded to half an ulp of |x| + |c|, which moves each weight by that much *relative*
    # (d weight / weight = d logit differences); twice that for the two logits in a difference,
    # plus 16 ulps for softmax's own exp, sum (<= 8 terms) and divide
    rtol = eps * (2 * (largest + shift) + 16)
    # weights are <= 1 and the relative bound holds for each; eps absolute only absorbs underflow noise
    np.testing.assert_allclose(
        softmax(x + c, axis=axis),
        softmax(x, axis=axis),
        rtol=rtol,
        atol=eps,
        err_msg=f"x {shape}, axis={axis}, |c| <= {shift}, {dtype.__name__}",
    )


# --- rope -------------------------------------------------------------------------------------

MAX_POSITION = 100_000
POSITIONS = st.integers(0, MAX_POSITION)


# what both rope tests draw: d = 2 · half_d (channels rotate in pairs), any base > 1, either pair layout;
# data draws T and the positions, whose length depends on T
ROPE_ARGS = dict(
    half_d=st.integers(1, 16),
    base=st.floats(1.5, 1e6),
    interleaved=st.booleans(),
    dtype=DTYPES,
    seed=SEEDS,
    data=st.data(),
)


@given(lead=hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3), **ROPE_ARGS)
def test_rope_preserves_norms(lead, half_d, base, interleaved, dtype, seed, data):
    """Each pair of channels is rotated, and a rotation keeps the length of every row."""
    n = data.draw(st.integers(1, 8), label="T")
    positions = data.draw(hnp.arrays(np.int64, n, elements=POSITIONS), label="positions")
    x = np.random.default_rng(seed).standard_normal((*lead, n, 2 * half_d)).astype(dtype)  # (..., T, d)
    rotated = rope(x, positions=positions, base=base, interleaved=interleaved)
    assert rotated.shape == x.shape and rotated.dtype == dtype
    eps = np.finfo(dtype).eps
    # each rotated pair (x1 cos - x2 sin, x1 sin + x2 cos) is two products and a sum in the dtype,
    # with cos and sin themselves rounded: a few ulps of the pair's length; 8 ulps leaves room
    np.testing.assert_allclose(
        np.linalg.norm(rotated.astype(np.float64), axis=-1),
        np.linalg.norm(x.astype(np.float64), axis=-1),
        rtol=8 * eps,
        atol=0,
        err_msg=f"x {x.shape}, base={base}, interleaved={interleaved}, {dtype.__name__}",
    )


@given(**ROPE_ARGS)
def test_rope_scores_depend_only_on_position_differences(half_d, base, interleaved, dtype, seed, data):
    """rope(q at m) · rope(k at n) == rope(q at m + s) · rope(k at n + s): the score sees only m - n.

    Row i of q sits at m[i], row i of k at n[i], and row i is shifted by s[i] (kept >= -min(m, n), so
    that no position is negative); each row's dot product is one drawn case."""
    n = data.draw(st.integers(1, 8), label="T")
    m_pos = data.draw(hnp.arrays(np.int64, n, elements=POSITIONS), label="m")
    n_pos = data.draw(hnp.arrays(np.int64, n, elements=POSITIONS), label="n")
    shift = data.draw(hnp.arrays(np.int64, n, elements=st.integers(-MAX_POSITION, MAX_POSITION)), label="shift")
    shift = np.maximum(shift, -np.minimum(m_pos, n_pos))
    rng = np.random.default_rng(seed)
    d = 2 * half_d
    q, k = (rng.standard_normal((n, d)).astype(dtype) for _ in range(2))  # (T, d)

    def scores(m, n):  # (T,): row i's q at position m[i] dotted with row i's k at position n[i]
        kw = dict(base=base, interleaved=interleaved)
        return np.sum(rope(q, positions=m, **kw).astype(np.float64) * rope(k, positions=n, **kw), axis=-1)

    before, after = scores(m_pos, n_pos), scores(m_pos + shift, n_pos + shift)
    eps = np.finfo(dtype).eps
    largest = float(np.max([m_pos, n_pos, m_pos + shift, n_pos + shift]))
    # each rotated vector is within a few ulps (in the dtype) of its length, and its angles m·θ are
    # rounded in float64 to half an ulp of m·θ <= m (θ_0 = 1): an absolute angle error of eps64/2 · m.
    # Both error kinds scale the score by |q||k| (Cauchy-Schwarz); 2 sides, 2 vectors each, room x2
    per_length = 2 * 2 * (8 * eps + np.finfo(np.float64).eps / 2 * largest)
    bound = per_length * np.linalg.norm(q.astype(np.float64), axis=-1) * np.linalg.norm(k.astype(np.float64), axis=-1)
    np.testing.assert_array_less(
        np.abs(before - after),
        bound,
        err_msg=f"T={n}, d={d}, m={m_pos}, n={n_pos}, shift={shift}, base={base}, "
        f"interleaved={interleaved}, {dtype.__name__}",
    )


# --- causal_mask alignments --------------------------------------------------------------------


@given(n_q=st.integers(0, 64), n_k=st.integers(0, 64))
def test_causal_alignments(n_q, n_k):
    """Both alignments cut from one square lower triangle of side max(L, S): top-left takes its first
    L rows and S columns, bottom-right its last ones (the newest queries against every key so far).
    So they agree when L == S and differ whenever L != S and neither is 0."""
    top_left = causal_mask(n_q, n_k, align="top_left")
    bottom = causal_mask(n_q, n_k)  # bottom-right is the default
    side = max(n_q, n_k)
    square = causal_mask(side, side, align="top_left")
    what = f"L={n_q}, S={n_k}"
    np.testing.assert_array_equal(top_left, square[:n_q, :n_k], err_msg=what)
    np.testing.assert_array_equal(bottom, square[side - n_q :, side - n_k :], err_msg=what)
    if n_q == n_k:
        np.testing.assert_array_equal(bottom, top_left, err_msg=what)
        np.testing.assert_array_equal(causal_mask(n_q), top_left, err_msg=what)
    elif min(n_q, n_k) >= 1:
        # L < S: query 0 sees key S - L bottom-right, not top-left; L > S: query 0 sees key 0 only top-left
        assert not np.array_equal(bottom, top_left), what
