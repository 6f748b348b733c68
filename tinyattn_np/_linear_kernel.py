"""The gated delta rule's engine: every head at once, the chunks in groups, the heads over worker threads, the
decode step in one read of the state. The lesson is linear.py (read its plain loops first); this module never
imports it and takes prepared arrays:

    q, k (..., T, d_k)    v (..., T, d_v)    g (..., T, 1) or (..., T, d_k)    beta (..., T)    state (..., d_k, d_v)

q and k repeated to the value heads, everything in the compute dtype; g the log decay, one per head (last axis 1)
or one per key channel (Kimi), all <= 0. The chunked functions L2-normalise q and k where asked and scale q by
d_k^-½ themselves (Prep), a group of chunks at a time as they read it, in their workers; the recurrence takes
them prepared (prepare_qk).

A chunk of C tokens entering with the state S (derived on docs/linear.md):

    γ = cumsum(g) over the chunk                 the log decay from the chunk's start to each token
    A_ij = β_i k_iᵀ k_j e^(γ_i − γ_j), i > j     T = (I + A)⁻¹: the UT transform, a unit lower-triangular inverse
    U = T (β v)      W = T (β e^γ k)             u = U − W S: what each token writes
    o = (e^γ q) S + P u                          P_ij = q_iᵀ k_j e^(γ_i − γ_j), j <= i
    S' = e^(γ_C) S + (e^(γ_C − γ) k)ᵀ u

Why this is fast. Everything that does not depend on S (γ, A, T, U, W, P: the first phase) runs for a group of
chunks of the heads at once, a few large NumPy calls; only the last three lines walk the chunks one after
another (the scan), three matmuls a chunk over the heads: [W; e^γ q] S in one, P u, and the write. T comes from
blocks of 16 rows inverted by forward substitution, then joined two by two (invert_unit_lower). Per-channel
decays never build a C x C x d_k array: the rows of a sub-block measure their decays from the row before it, so
every exponent is <= 0 and the products left of the diagonal block are matmuls (decayed_products). Each worker
thread takes a part of the heads, BLAS one thread each: small matmuls on BLAS's own threads wait on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._guard import refuse_unless_fits
from ._parallel import cpu_cores, l2_cache_bytes, one_blas_thread, run_items

__all__ = [
    "L2_EPS",
    "Prep",
    "backward_numbers",
    "chunked_backward",
    "chunked_forward",
    "decayed_products",
    "decayed_products_backward",
    "decode_step",
    "invert_unit_lower",
    "prepare_qk",
    "prepare_qk_backward",
    "recurrent_forward",
]

Array = NDArray[np.floating]

SUB_BLOCK = 16  # rows inverted by plain forward substitution, and a per-channel decay's sub-block
# a group of chunks' first-phase arrays take about one core's L2 cache (2 MiB where unknown), so that they stay in
# it from one line to the next, and are made again in memory the process already has (measured:
# docs/results/linear.md)
GROUP_BYTES = l2_cache_bytes() or 2**21
HEAD_TOKENS_PER_WORKER = 2**12  # fewer head-tokens than this a worker, and a call runs on fewer workers


L2_EPS = 1e-6  # q / √(‖q‖² + ε), as transformers and flash-linear-attention normalise q and k


class Prep(NamedTuple):
    """What becomes of q and k before the rule reads them: with l2norm each is made unit length first,
    x / √(‖x‖² + ε); then q is scaled by q_scale (d_k^-½)."""

    q_scale: float = 1.0
    l2norm: bool = False


def prepare_qk(q: Array, k: Array, prep: Prep) -> tuple[Array, Array]:
    """q and k (..., d_k) as the rule reads them, new arrays: q_scale · q̂ and k̂ (x̂ = x / √(‖x‖² + ε) with
    l2norm, else x)."""
    if not prep.l2norm:
        return q * prep.q_scale, k.copy()
    return q * (prep.q_scale * _inverse_norm(q)), k * _inverse_norm(k)


def prepare_qk_backward(dq: Array, dk: Array, q: Array, k: Array, prep: Prep) -> tuple[Array, Array]:
    """The gradients in q and k of prepare_qk from those in what it returned."""
    dq = dq * prep.q_scale
    return (_l2_normalize_backward(dq, q), _l2_normalize_backward(dk, k)) if prep.l2norm else (dq, dk)


def _inverse_norm(x: Array) -> Array:
    """1 / √(‖x‖² + ε) along the last axis: x (..., d) -> (..., 1)."""
    return 1.0 / np.sqrt(np.einsum("...d,...d->...", x, x)[..., None] + L2_EPS)


def _l2_normalize_backward(dy: Array, x: Array) -> Array:
    """y = x r with r = (‖x‖² + ε)^-½: dx = r (dy − y (yᵀdy)), since ∂r/∂x = −r³ x."""
    r = _inverse_norm(x)  # (..., 1)
    y = x * r
    return r * (dy - y * np.sum(y * dy, axis=-1, keepdims=True))


def _t(x: Array) -> Array:
    """xᵀ over the last two axes, laid out anew: NumPy hands a stack of transposed views to its own loops,
    many times slower than the BLAS it calls for a stack of contiguous matrices."""
    return np.ascontiguousarray(x.swapaxes(-1, -2))


# ---------------------------------------------------------------------------------------------------
# a chunk's own algebra: decayed products and the triangular inverse


def decayed_products(lefts: tuple[Array, ...], b: Array, gamma: Array, *, strict: bool) -> list[Array]:
    """For each a of lefts, M_ij = Σ_c a_ic b_jc e^(γ_ic − γ_jc) for j < i (strict) or j <= i, else 0: a, b
    (..., C, d), gamma (..., C, 1) or (..., C, d) non-increasing down the chunk -> M (..., C, C) each (bᵀ and the
    decays made once for all)."""
    if gamma.shape[-1] == 1:  # one decay per head: (a bᵀ) ∘ e^(γ_i − γ_j), masked before the exp (no overflow)
        b_t, decay = _t(b), _pairwise_decay(gamma[..., 0], strict)  # (..., d, C), (..., C, C)
        return [np.multiply(a @ b_t, decay, out=np.empty_like(decay)) for a in lefts]
    C = b.shape[-2]
    products = []
    for a in lefts:
        out = np.zeros((*a.shape[:-1], C), a.dtype)  # (..., C, C)
        for r0 in range(0, C, SUB_BLOCK):
            rows = slice(r0, min(r0 + SUB_BLOCK, C))
            if r0:  # the columns before the block: both factors measured from row r0 - 1, so e^(...) <= 1
                a_left, b_left = _split_at(a[..., rows, :], b[..., :r0, :], gamma, r0, rows)
                out[..., rows, :r0] = a_left @ _t(b_left)  # (..., s, r0)
            out[..., rows, rows] = _diagonal_block(a[..., rows, :], b[..., rows, :], gamma[..., rows, :], strict)
        products.append(out)
    return products


def _pairwise_decay(gamma: Array, strict: bool) -> Array:
    """e^(γ_i − γ_j) where j < i (strict) or j <= i, else 0: gamma (..., C) -> (..., C, C). The exponent is taken
    only below the diagonal, where it is <= 0: above it, γ_i − γ_j > 0 could overflow."""
    C = gamma.shape[-1]
    difference = gamma[..., :, None] - gamma[..., None, :]  # (..., C, C)
    return np.exp(difference, out=np.zeros_like(difference), where=np.tri(C, k=-1 if strict else 0, dtype=bool))


def _split_at(a_rows: Array, b_left: Array, gamma: Array, r0: int, rows: slice) -> tuple[Array, Array]:
    """a_i e^(γ_i − γ_r) and b_j e^(γ_r − γ_j) for r = r0 - 1, i in rows, j < r0: both exponents <= 0."""
    ref = gamma[..., r0 - 1 : r0, :]  # (..., 1, d)
    return a_rows * np.exp(gamma[..., rows, :] - ref), b_left * np.exp(ref - gamma[..., :r0, :])


def _diagonal_block(a: Array, b: Array, gamma: Array, strict: bool) -> Array:
    """decayed_products of one sub-block, per channel: (..., s, d) each -> (..., s, s), through (..., s, s, d)."""
    return np.einsum("...ic,...jc,...ijc->...ij", a, b, _block_decay(gamma, strict))


def _block_decay(gamma: Array, strict: bool) -> Array:
    """e^(γ_ic − γ_jc) for j < i (strict) or j <= i, else 0, in one sub-block: gamma (..., s, d) -> (..., s, s, d)."""
    lower = np.tri(gamma.shape[-2], k=-1 if strict else 0, dtype=bool)[..., None]  # (s, s, 1)
    return np.exp(np.where(lower, gamma[..., :, None, :] - gamma[..., None, :, :], -np.inf))


def decayed_products_backward(dm: Array, a: Array, b: Array, gamma: Array, *, strict: bool) -> tuple[Array, ...]:
    """The gradients of decayed_products from dm (..., C, C): da_ic = Σ_j dm_ij b_jc e^(γ_ic − γ_jc),
    db_jc = Σ_i dm_ij a_ic e^(γ_ic − γ_jc), and dγ = a ∘ da − b ∘ db (∂e^(γ_i − γ_j) is +1 in γ_i, −1 in γ_j),
    summed to gamma's shape. Entries of dm outside the triangle count for nothing."""
    da: Array
    db: Array
    if gamma.shape[-1] == 1:
        dm_decayed = dm * _pairwise_decay(gamma[..., 0], strict)  # (..., C, C)
        da, db = dm_decayed @ b, _t(dm_decayed) @ a  # (..., C, d) each
    else:
        da, db = _channel_backward(dm, a, b, gamma, strict)
    dgamma = a * da - b * db  # (..., C, d)
    return da, db, dgamma.sum(axis=-1, keepdims=True) if gamma.shape[-1] == 1 else dgamma


def _channel_backward(dm: Array, a: Array, b: Array, gamma: Array, strict: bool) -> tuple[Array, Array]:
    """da and db of decayed_products with one decay per channel, sub-block by sub-block as the forward."""
    C = a.shape[-2]
    da, db = np.zeros_like(a), np.zeros_like(b)  # (..., C, d) each
    for r0 in range(0, C, SUB_BLOCK):
        rows = slice(r0, min(r0 + SUB_BLOCK, C))
        if r0:
            a_left, b_left = _split_at(a[..., rows, :], b[..., :r0, :], gamma, r0, rows)
            ref = gamma[..., r0 - 1 : r0, :]  # (..., 1, d)
            da[..., rows, :] += (dm[..., rows, :r0] @ b_left) * np.exp(gamma[..., rows, :] - ref)  # (..., s, d)
            db[..., :r0, :] += (_t(dm[..., rows, :r0]) @ a_left) * np.exp(ref - gamma[..., :r0, :])
        decay, dm_block = _block_decay(gamma[..., rows, :], strict), dm[..., rows, rows]  # (..., s, s, d), (..., s, s)
        da[..., rows, :] += np.einsum("...ij,...jc,...ijc->...ic", dm_block, b[..., rows, :], decay)
        db[..., rows, :] += np.einsum("...ij,...ic,...ijc->...jc", dm_block, a[..., rows, :], decay)
    return da, db


def invert_unit_lower(a: Array) -> Array:
    """(I + A)⁻¹ for A (..., C, C) strictly lower triangular (its diagonal and what lies above are never read):
    blocks of SUB_BLOCK rows by forward substitution, then pairs of blocks joined, [[T₁, 0], [A₂₁, T₂]]⁻¹ =
    [[T₁, 0], [−T₂ A₂₁ T₁, T₂]], doubling to C."""
    C = a.shape[-1]
    inverse = np.zeros_like(a)  # (..., C, C)
    blocks = [slice(r0, min(r0 + SUB_BLOCK, C)) for r0 in range(0, C, SUB_BLOCK)]
    whole = [rows for rows in blocks if rows.stop - rows.start == SUB_BLOCK]  # substituted all at once
    inverted = _substitute(np.stack([a[..., rows, rows] for rows in whole], axis=-3)) if whole else a[..., :0, :0]
    for i, rows in enumerate(blocks):  # (..., m, s, s): the m whole blocks; a shorter last one on its own
        inverse[..., rows, rows] = inverted[..., i, :, :] if i < len(whole) else _substitute(a[..., rows, rows])
    size = SUB_BLOCK
    while size < C:
        for r0 in range(0, C - size, 2 * size):
            top, low = slice(r0, r0 + size), slice(r0 + size, min(r0 + 2 * size, C))
            inverse[..., low, top] = -inverse[..., low, low] @ (a[..., low, top] @ inverse[..., top, top])
        size *= 2
    return inverse


def _substitute(a: Array) -> Array:
    """(I + A)⁻¹ for one small strictly lower A (..., s, s), row by row: row i = e_i − A_i,:i (rows before i)."""
    s = a.shape[-1]
    inverse: Array = np.broadcast_to(np.eye(s, dtype=a.dtype), a.shape).copy()  # (..., s, s)
    for i in range(1, s):
        inverse[..., i, :i] = -np.einsum("...j,...jc->...c", a[..., i, :i], inverse[..., :i, :i])
    return inverse


# ---------------------------------------------------------------------------------------------------
# the heads over worker threads


def chunked_forward(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, chunk_size: int, prep: Prep
) -> tuple[Array, Array]:
    """o (..., T, d_v) and the final state (..., d_k, d_v), chunk_size tokens a chunk; q and k as they come, each
    group of chunks prepared (prep) as it is read."""
    inputs, T, C = _flat_heads(q, k, v, g, beta), v.shape[-2], chunk_size
    heads = inputs.q.shape[0]
    _refuse(heads, -(-T // C), C, q.shape[-1], v.shape[-1], q.dtype, keep=False)
    o, final = np.empty((heads, T, v.shape[-1]), v.dtype), np.empty((heads, *state.shape[-2:]), state.dtype)
    states = state.reshape(heads, *state.shape[-2:])  # (N, d_k, d_v)

    def run(part: slice) -> None:
        final[part] = _forward(inputs.part(part), states[part], C, prep, out=o[part])

    _over_heads(run, heads, T)
    return o.reshape(v.shape), final.reshape(state.shape)


def chunked_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    state: Array,
    dout: Array,
    dstate: Array,
    chunk_size: int,
    prep: Prep,
) -> tuple[Array, ...]:
    """The gradients dq, dk, dv, dg, dbeta (the inputs' shapes; dq and dk through prep) and dstate_0 (the state's)
    of chunked_forward, from dout = ∂loss/∂o (..., T, d_v) and dstate = ∂loss/∂(the final state) (..., d_k, d_v)."""
    inputs, T = _flat_heads(q, k, v, g, beta), v.shape[-2]
    heads = inputs.q.shape[0]
    _refuse(heads, -(-T // chunk_size), chunk_size, q.shape[-1], v.shape[-1], q.dtype, keep=True)
    grads = [np.empty_like(x) for x in inputs] + [np.empty((heads, *state.shape[-2:]), state.dtype)]
    dout = dout.reshape(heads, *dout.shape[-2:])  # (N, T, d_v)
    states, dstates = (x.reshape(heads, *x.shape[-2:]) for x in (state, dstate))  # (N, d_k, d_v) each

    def run(part: slice) -> None:
        parts = [grad[part] for grad in grads[:5]]
        grads[5][part] = _backward(inputs.part(part), dout[part], states[part], dstates[part], chunk_size, prep, parts)

    _over_heads(run, heads, T)
    shapes = (q.shape, k.shape, v.shape, g.shape, beta.shape, state.shape)
    return tuple(grad.reshape(shape) for grad, shape in zip(grads, shapes, strict=True))


def recurrent_forward(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
    """o (..., T, d_v) and the final state, token by token as linear.gated_delta_rule_recurrent: a decode_step each,
    the state written in place in the array returned (a new one: `state` is left as it was)."""
    inputs, T = _flat_heads(q, k, v, g, beta), v.shape[-2]
    heads, states = inputs.q.shape[0], state.reshape(-1, *state.shape[-2:])  # N, (N, d_k, d_v)
    o, final = np.empty((heads, T, v.shape[-1]), v.dtype), np.empty_like(states)

    def run(part: slice) -> None:
        x, now, scratch = inputs.part(part), states[part], np.empty_like(states[part])  # scratch: k uᵀ
        for t in range(T):  # the first step reads `state` and writes `final`, the others `final` in place
            o[part, t], now = decode_step(
                x.q[:, t], x.k[:, t], x.v[:, t], x.g[:, t], x.beta[:, t], now, out=final[part], scratch=scratch
            )
        if T == 0:
            final[part] = now

    _over_heads(run, heads, T)
    return o.reshape(v.shape), final.reshape(state.shape)


class Tokens(NamedTuple):
    """The rule's inputs for N heads: q, k (N, T, d_k), v (N, T, d_v), g (N, T, 1|d_k), beta (N, T); or the same
    cut into n chunks of C tokens, (N, n, C, ·) and beta (N, n, C)."""

    q: Array
    k: Array
    v: Array
    g: Array
    beta: Array

    def part(self, heads: slice) -> Tokens:
        return Tokens(self.q[heads], self.k[heads], self.v[heads], self.g[heads], self.beta[heads])

    def chunks(self, C: int, start: int, stop: int) -> Tokens:
        """Tokens start .. stop (a whole number of chunks) as chunks, zeros past the end T: a zero token has
        k = 0 and g = 0, so it neither writes nor decays the state."""
        q, k, v, g, beta = (_chunks(x, C, start, stop) for x in (self.q, self.k, self.v, self.g, self.beta[..., None]))
        return Tokens(q, k, v, g, beta[..., 0])

    def prepared(self, prep: Prep) -> Tokens:
        """The same tokens with q and k as the rule reads them (prepare_qk): new arrays, the size of these."""
        q, k = prepare_qk(self.q, self.k, prep)
        return self._replace(q=q, k=k)


def _chunks(x: Array, C: int, start: int, stop: int) -> Array:
    """Tokens start .. stop of x (N, T, d) as (N, n, C, d), zeros past T."""
    part = x[:, start : min(stop, x.shape[1])]  # (N, ·, d)
    if stop > x.shape[1]:
        part = np.pad(part, [(0, 0), (0, stop - x.shape[1]), (0, 0)])
    return part.reshape(x.shape[0], -1, C, x.shape[-1])


def _flat_heads(q: Array, k: Array, v: Array, g: Array, beta: Array) -> Tokens:
    """The inputs with their leading axes (B, Hv) as one axis of N heads (a view where they are contiguous)."""
    N = int(np.prod(v.shape[:-2]))
    return Tokens(
        q.reshape(N, *q.shape[-2:]),
        k.reshape(N, *k.shape[-2:]),
        v.reshape(N, *v.shape[-2:]),
        g.reshape(N, *g.shape[-2:]),
        beta.reshape(N, -1),
    )


def _over_heads(run: Callable[[slice], None], heads: int, tokens: int) -> None:
    """run(part) for parts of the N heads, one part a worker thread, BLAS one thread each: a worker per core, no
    more than one a head or per HEAD_TOKENS_PER_WORKER head-tokens. Each head's numbers are the same in any part."""
    workers = _workers(heads, tokens)
    bounds = np.linspace(0, heads, workers + 1).round().astype(int)  # (workers + 1,)
    with one_blas_thread():
        run_items(run, [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], workers)


def _workers(heads: int, tokens: int) -> int:
    return max(1, min(cpu_cores(), heads, heads * tokens // HEAD_TOKENS_PER_WORKER))


def backward_numbers(heads: int, T: int, C: int, d_k: int, d_v: int, itemsize: int) -> int:
    """About how many numbers chunked_backward holds at its fullest besides its arguments, for N = heads of T
    tokens in chunks of C: the gradients (N T (2 d_k + d_v + 2)), the state entering each chunk and every write
    (the chunks padded to C tokens), and each worker's group of chunks while the group's gradients are taken:
    its first phase, the scan's gradients and the first phase's backward, about 7 C + 18 d_k numbers a head
    and token (tests/test_trainbill.py holds a training step's bill within 10% of tracemalloc's)."""
    n, workers = -(-T // C), _workers(heads, T)
    per_worker = -(-heads // workers)
    group = workers * per_worker * min(n, chunks_per_group(per_worker, C, d_k, d_v, itemsize)) * C
    return heads * (T * (2 * d_k + d_v + 2) + n * (d_k * d_v + C * d_v)) + group * (7 * C + 18 * d_k)


def _refuse(heads: int, n: int, C: int, d_k: int, d_v: int, dtype: np.dtype, *, keep: bool) -> None:
    """AttentionMemoryError before the chunks run: the output and, for the backward, the state entering every
    chunk, every write and the gradients; plus each worker's group of first-phase arrays."""
    out = heads * n * C * d_v
    kept = heads * n * (d_k * d_v + 3 * C * (d_k + d_v)) if keep else 0
    group = (GROUP_BYTES + heads * C * SUB_BLOCK * d_k * dtype.itemsize) * min(heads, cpu_cores())
    what = f"{n} chunks of {C} tokens for {heads} heads of d_k={d_k}, d_v={d_v}"
    refuse_unless_fits((out + kept) * dtype.itemsize + group, "gated_delta_rule", what, "pass fewer tokens or heads")


# ---------------------------------------------------------------------------------------------------
# the first phase: what a group of chunks needs from its own tokens


class ChunkTerms(NamedTuple):
    """The state-free terms of n chunks of C tokens, every array (N, n, ·, ·): gamma (C, 1|d_k), inverse (C, C)
    = (I + A)⁻¹, u (C, d_v) = T β v, wq (2C, d_k) = [W; e^γ q], p (C, C), k_to_end_t (d_k, C) = (e^(γ_C − γ) k)ᵀ,
    chunk_decay (1|d_k, 1) = e^(γ_C)."""

    gamma: Array
    inverse: Array
    u: Array
    wq: Array
    p: Array
    k_to_end_t: Array
    chunk_decay: Array


def chunk_terms(x: Tokens) -> ChunkTerms:
    """The first phase for chunks x (N, n, C, ·)."""
    C = x.q.shape[-2]
    gamma = np.cumsum(x.g, axis=-2)  # (N, n, C, 1|d_k)
    decay = np.exp(gamma)  # (N, n, C, 1|d_k): e^γ <= 1
    a, p = decayed_products((x.k, x.q), x.k, gamma, strict=False)  # (N, n, C, C) each: k kᵀ and q kᵀ, decayed
    a *= x.beta[..., :, None]  # A = diag(β) (k kᵀ ∘ e^(γ_i − γ_j)), its diagonal too, which the inverse never reads
    inverse = invert_unit_lower(a)  # (N, n, C, C): (I + A)⁻¹
    u = inverse @ (x.v * x.beta[..., None])  # (N, n, C, d_v)
    wq = np.empty((*x.q.shape[:-2], 2 * C, x.q.shape[-1]), x.q.dtype)  # (N, n, 2C, d_k)
    np.matmul(inverse, x.k * (x.beta[..., None] * decay), out=wq[..., :C, :])  # W = T β e^γ k
    np.multiply(x.q, decay, out=wq[..., C:, :])  # e^γ q
    k_to_end_t = _t(x.k * np.exp(gamma[..., -1:, :] - gamma))  # (N, n, d_k, C): (e^(γ_C − γ) k)ᵀ
    return ChunkTerms(gamma, inverse, u, wq, p, k_to_end_t, decay[..., -1, :, None])


def chunks_per_group(heads: int, C: int, d_k: int, d_v: int, itemsize: int) -> int:
    """Chunks in a group: their first-phase arrays (heads x (3C² + C (3 d_k + 2 d_v)) numbers a chunk) near
    GROUP_BYTES."""
    return max(1, GROUP_BYTES // (heads * (3 * C * C + C * (3 * d_k + 2 * d_v)) * itemsize))


# ---------------------------------------------------------------------------------------------------
# the scan: the state through the chunks, forward and backward


class Kept(NamedTuple):
    """What the backward keeps of a forward: the state entering each chunk (n, N, d_k, d_v) and every token's
    write u = U − W S (N, n·C, d_v)."""

    states: Array
    writes: Array


def _forward(
    x: Tokens, state: Array, C: int, prep: Prep, *, out: Array | None = None, kept: Kept | None = None
) -> Array:
    """The groups in order, each's first phase then its scan: the outputs into out (N, T, d_v) (None: none made,
    as the backward's second forward needs only the states and the writes, kept) and the final state
    (N, d_k, d_v). The scan writes into buffers made once: each step's arrays are as large as the state, and new
    memory costs the process more than the arithmetic on it."""
    (heads, T, d_k), d_v = x.q.shape, x.v.shape[-1]
    n, rows = -(-T // C), C if out is None else 2 * C  # without outputs, only W S is read
    state = state.copy()  # (N, d_k, d_v): from here on written in place
    read, write = np.empty((heads, rows, d_v), x.v.dtype), np.empty((heads, C, d_v), x.v.dtype)
    products, update = np.empty_like(write), np.empty_like(state)  # (N, C, d_v), (N, d_k, d_v)
    step = chunks_per_group(heads, C, d_k, d_v, x.q.dtype.itemsize) * C
    for start in range(0, n * C, step):
        terms = chunk_terms(x.chunks(C, start, min(start + step, n * C)).prepared(prep))
        for c in range(terms.u.shape[1]):
            first = start + c * C  # the chunk's first token
            if kept is not None:
                kept.states[first // C] = state
            np.matmul(terms.wq[:, c, :rows], state, out=read)  # (N, 2C, d_v): [W S; e^γ q S]
            np.subtract(terms.u[:, c], read[:, :C], out=write)  # (N, C, d_v): u = U − W S
            if out is not None:  # o = e^γ q S + P u, the chunk's tokens before T
                last = min(C, T - first)
                np.add(
                    read[:, C : C + last],
                    np.matmul(terms.p[:, c], write, out=products)[:, :last],
                    out=out[:, first : first + last],
                )
            state *= terms.chunk_decay[:, c]  # S' = e^(γ_C) S + (e^(γ_C − γ) k)ᵀ u
            state += np.matmul(terms.k_to_end_t[:, c], write, out=update)
            if kept is not None:
                kept.writes[:, first : first + C] = write
    return state


def _backward(x: Tokens, dout: Array, state: Array, dstate: Array, C: int, prep: Prep, grads: list[Array]) -> Array:
    """chunked_backward for N heads (N, T, ·): the forward again, keeping the state entering each chunk; then the
    groups from the last: the first phase again, the scan backward (dS from chunk to chunk, _scan_backward), and
    the first phase's own gradients for the whole group (chunk_terms_backward), through prep to q and k. The
    gradients of q, k, v, g, beta go into grads (N, T, ·) each; returns that of the state the rule started from."""
    heads, T = x.q.shape[:2]
    n = -(-T // C)
    kept = Kept(np.empty((n, *state.shape), state.dtype), np.empty((heads, n * C, x.v.shape[-1]), x.v.dtype))
    _forward(x, state, C, prep, kept=kept)
    dout = _chunks(dout, C, 0, n * C)  # (N, n, C, d_v), zeros past T
    writes = kept.writes.reshape(heads, n, C, -1)  # (N, n, C, d_v)
    step = chunks_per_group(heads, C, x.q.shape[-1], x.v.shape[-1], x.q.dtype.itemsize) * C
    dstate = dstate.copy()  # (N, d_k, d_v): dS, the gradient of the state leaving the chunk at hand
    for start in reversed(range(0, n * C, step)):
        stop = min(start + step, n * C)
        raw, group = x.chunks(C, start, stop), slice(start // C, stop // C)
        chunks = raw.prepared(prep)
        terms = chunk_terms(chunks)
        d_scan, dstate = _scan_backward(terms, kept.states[group], writes[:, group], dout[:, group], dstate)
        dq, dk, *rest = chunk_terms_backward(terms, chunks, d_scan)
        dq, dk = prepare_qk_backward(dq, dk, raw.q, raw.k, prep)
        last = min(stop, T) - start  # the group's tokens before T
        for grad, part in zip(grads, [dq, dk, *rest], strict=True):
            grad[:, start : start + last] = part.reshape(heads, stop - start, *grad.shape[2:])[:, :last]
    return dstate


class ScanGrads(NamedTuple):
    """The scan backward's gradients of a group's ChunkTerms, each (N, n, ·, ·): du (C, d_v), dwq (2C, d_k),
    dp (C, C), dk_to_end (C, d_k), dchunk_decay (1|d_k, 1)."""

    du: Array
    dwq: Array
    dp: Array
    dk_to_end: Array
    dchunk_decay: Array


def _scan_backward(
    terms: ChunkTerms, states: Array, writes: Array, dout: Array, dstate: Array
) -> tuple[ScanGrads, Array]:
    """The scan's gradients, chunk by chunk from the last, with dS the gradient of the state leaving the chunk
    (u = U − W S is read by o and by S'):
        du = Pᵀ do + e^(γ_C − γ) k dS       d[W; e^γ q] = [−du; do] Sᵀ      dS ← e^(γ_C) dS + [W; e^γ q]ᵀ [−du; do]
        dP = do uᵀ                          dk_to_end = u dSᵀ               de^(γ_C) = Σ_v dS ∘ S"""
    grads = ScanGrads(
        *(np.empty_like(a) for a in (terms.u, terms.wq, terms.p, _t(terms.k_to_end_t), terms.chunk_decay))
    )
    for c in reversed(range(terms.u.shape[1])):
        state, write, do = states[c], writes[:, c], dout[:, c]  # (N, d_k, d_v), (N, C, d_v), (N, C, d_v)
        du = _t(terms.p[:, c]) @ do + _t(terms.k_to_end_t[:, c]) @ dstate  # (N, C, d_v)
        stacked = np.concatenate([-du, do], axis=-2)  # (N, 2C, d_v)
        np.matmul(stacked, _t(state), out=grads.dwq[:, c])
        np.matmul(do, _t(write), out=grads.dp[:, c])
        np.matmul(write, _t(dstate), out=grads.dk_to_end[:, c])
        grads.dchunk_decay[:, c] = _sum_to(np.sum(dstate * state, axis=-1, keepdims=True), grads.dchunk_decay[:, c])
        grads.du[:, c] = du
        dstate = terms.chunk_decay[:, c] * dstate + _t(terms.wq[:, c]) @ stacked  # (N, d_k, d_v)
    return grads, dstate


def _sum_to(x: Array, like: Array) -> Array:
    """x summed over the axes where `like` has 1 and x more, kept: (..., d_k, 1) -> (..., 1, 1) for one decay a head."""
    axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, like.shape, strict=True)) if want == 1 < have)
    return x.sum(axis=axes, keepdims=True) if axes else x


def chunk_terms_backward(terms: ChunkTerms, x: Tokens, d: ScanGrads) -> tuple[Array, ...]:
    """dq, dk, dv, dg, dbeta of a group of chunks x (N, n, C, ·) from the scan's gradients. With X = β v,
    Y = β e^γ k, U = T X, W = T Y and T = (I + A)⁻¹ (so dT = −T dA T):
        dX = Tᵀ dU      dY = Tᵀ dW      dA = −(dX Uᵀ + dY Wᵀ), on the strict lower triangle
    then A, P, e^γ q, e^(γ_C − γ) k and e^(γ_C) back to q, k, v, β and γ; γ = cumsum(g), so dg is dγ's reverse
    cumsum."""
    C, gamma = x.q.shape[-2], terms.gamma  # gamma (N, n, C, 1|d_k)
    decay, k_beta = np.exp(gamma), x.k * x.beta[..., None]  # (N, n, C, 1|d_k), (N, n, C, d_k)
    inverse_t = _t(terms.inverse)  # (N, n, C, C)
    dx, dy = inverse_t @ d.du, inverse_t @ d.dwq[..., :C, :]  # (N, n, C, d_v), (N, n, C, d_k)
    da = -(dx @ _t(terms.u) + dy @ _t(terms.wq[..., :C, :]))  # (N, n, C, C)
    dk_beta, dk, dgamma = decayed_products_backward(da, k_beta, x.k, gamma, strict=True)  # A
    dq, dk_p, dgamma_p = decayed_products_backward(d.dp, x.q, x.k, gamma, strict=False)  # P
    dk += dk_p
    dgamma += dgamma_p + _sum_to(dy * k_beta * decay, gamma)  # Y = k_beta e^γ
    dk_beta += dy * decay
    dbeta = np.sum(x.v * dx, axis=-1) + np.sum(x.k * dk_beta, axis=-1)  # (N, n, C): X = β v, k_beta = β k
    dk += x.beta[..., None] * dk_beta
    dq_decayed = d.dwq[..., C:, :]  # (N, n, C, d_k): through e^γ q
    dq += dq_decayed * decay
    dgamma += _sum_to(dq_decayed * x.q * decay, gamma)
    dk_to_end = d.dk_to_end * np.exp(gamma[..., -1:, :] - gamma)  # (N, n, C, d_k): through e^(γ_C − γ) k
    dk += dk_to_end
    moved = _sum_to(dk_to_end * x.k, gamma)  # (N, n, C, 1|d_k)
    dgamma -= moved
    dgamma[..., -1, :] += moved.sum(axis=-2) + d.dchunk_decay[..., 0] * terms.chunk_decay[..., 0]  # γ_C's own
    dg = np.flip(np.cumsum(np.flip(dgamma, axis=-2), axis=-2), axis=-2)  # dg_t = Σ_{i >= t} dγ_i
    return dq, dk, x.beta[..., None] * dx, dg, dbeta


# ---------------------------------------------------------------------------------------------------
# the decode step


def decode_step(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    state: Array,
    *,
    out: Array | None = None,
    scratch: Array | None = None,
) -> tuple[Array, Array]:
    """One token: q, k (..., d_k), v (..., d_v), g (..., 1|d_k), beta (...), state (..., d_k, d_v) -> o (..., d_v)
    and the new state, written into `out` (new where None; `state` itself for a step in place); scratch: a buffer
    of the state's shape for k uᵀ. One read of the old state S gives both products; then the write:
        r_k, r_q = (e^g S)ᵀ k, (e^g S)ᵀ q      u = β (v − r_k)      o = r_q + u (kᵀq)      S' = e^g S + k uᵀ
    k uᵀ is a matmul over two columns, [k 0] [u 0]ᵀ, which NumPy hands to BLAS (an outer product, or a matmul
    over one column, it runs in its own loops: measured on docs/results/linear.md)."""
    decay = np.exp(g)  # (..., 1|d_k)
    x = np.stack([k, q], axis=-2)  # (..., 2, d_k)
    if g.shape[-1] > 1:  # a decay per key channel scales the rows of S: (e^g ∘ S)ᵀ x = Sᵀ (e^g ∘ x)
        x *= decay[..., None, :]
    reads = x @ state  # (..., 2, d_v): Sᵀk and Sᵀq, the one read of S
    if g.shape[-1] == 1:
        reads *= decay[..., None]
    write = beta[..., None] * (v - reads[..., 0, :])  # (..., d_v): u
    o = reads[..., 1, :] + write * np.sum(k * q, axis=-1, keepdims=True)  # (..., d_v): S'ᵀq without S'
    columns, rows = np.zeros((*k.shape, 2), k.dtype), np.zeros((*write.shape[:-1], 2, write.shape[-1]), k.dtype)
    columns[..., 0], rows[..., 0, :] = k, write  # [k 0] (..., d_k, 2) and [u 0]ᵀ (..., 2, d_v)
    new = np.multiply(state, decay[..., :, None], out=out)  # (..., d_k, d_v): e^g S
    new += np.matmul(columns, rows, out=scratch)  # + k uᵀ
    return o, new
