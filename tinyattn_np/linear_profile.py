"""Where the gated delta rule's chunked prefill spends its time: _linear_kernel's forward (the first phase of each
group of chunks, then the scan) copied statement for statement, each NumPy call timed into its part, on one
thread, for one decay a head (Qwen3-Next's form), as profiler.py does for flash attention's kernels (its Stopwatch
and measure_parts). The copy calls the engine's own helpers and must give its bits. scripts/linear.py prints it:
the matmuls against their FLOPs at the machine's matmul rate, and what each part after them adds.

    profile_chunked(q, k, v, g, beta, chunk_size=64, repeats=3, matmul_rate=...)   -> its parts and FLOPs
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._checks import check_bool, check_positive_int
from ._linear_checks import check_delta_inputs
from ._linear_kernel import (
    ChunkTerms,
    Prep,
    Tokens,
    _flat_heads,
    _forward,
    _pairwise_decay,
    _t,
    chunks_per_group,
    invert_unit_lower,
)
from .profiler import PARTS, measure_parts

__all__ = ["LINEAR_PARTS", "profile_chunked"]

MATMULS, COPIES = PARTS[0], PARTS[-1]
INVERSE, ELEMENTWISE = "the triangular inverse", "element-wise lines"
LINEAR_PARTS = (MATMULS, INVERSE, ELEMENTWISE, COPIES)


def profile_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    *,
    chunk_size: int = 64,
    l2norm_qk: bool = True,
    repeats: int,
    matmul_rate: Callable[[], float],
) -> dict[str, Any]:
    """gated_delta_rule's chunked forward on one thread, every head in one part (as one worker takes them), split
    into LINEAR_PARTS: the matmuls (k kᵀ, q kᵀ, T β v, T β e^γ k; then a chunk at a time [W; e^γ q] S, P u,
    (e^(γ_C − γ) k)ᵀ u), the triangular inverse (invert_unit_lower: substitution and its block products), the
    element-wise lines (γ, the decays, β, the l2 norms, u = U − W S, o's sum, S's decay and sum), the copies.
    q, k, v (B, H, T, d), g and beta (B, H, T): one decay a head, q and k heads as many as v's.
    flops: the matmuls', 2 · (5 C² d + 3 C d²) a chunk of a head (d = d_k = d_v), T padded to whole chunks."""
    chunk_size, l2norm_qk = check_positive_int(chunk_size, "chunk_size"), check_bool(l2norm_qk, "l2norm_qk")
    x = check_delta_inputs(q, k, v, g, beta, None, grouped=False)
    if x.v.ndim != 4 or x.g.shape[-1] != 1 or x.q.shape[-1] != x.v.shape[-1]:
        raise ValueError(
            f"profile_chunked takes q, k, v (B, H, T, d) of one width and g (B, H, T), one decay a head; got q "
            f"{x.q.shape}, v {x.v.shape}, g {np.shape(g)}"
        )
    tokens, prep = _flat_heads(x.q, x.k, x.v, x.g, x.beta), Prep(x.q.shape[-1] ** -0.5, l2norm_qk)
    heads, T, d = tokens.q.shape
    state = x.state.reshape(heads, d, d)  # zeros

    def kernel() -> tuple[np.ndarray, np.ndarray]:
        out = np.empty((heads, T, d), tokens.v.dtype)
        return out, _forward(tokens, state, chunk_size, prep, out=out)

    row = measure_parts(
        kernel, lambda clock: forward_copy(tokens, state, chunk_size, prep, clock), repeats, matmul_rate, LINEAR_PARTS
    )
    C, n = chunk_size, -(-T // chunk_size)
    row.update(flops=2 * heads * n * (5 * C * C * d + 3 * C * d * d), chunks=n)
    return row


def forward_copy(x: Tokens, state: np.ndarray, C: int, prep: Prep, clock: Any) -> tuple[np.ndarray, np.ndarray]:
    """_linear_kernel._forward with outputs, its statements in its order, each timed into its part: o (N, T, d_v)
    and the final state (N, d_k, d_v), the engine's bits."""
    (heads, T, d_k), d_v = x.q.shape, x.v.shape[-1]
    n = -(-T // C)
    with clock(COPIES):
        out, state = np.empty((heads, T, d_v), x.v.dtype), state.copy()
        read, write = np.empty((heads, 2 * C, d_v), x.v.dtype), np.empty((heads, C, d_v), x.v.dtype)
        products, update = np.empty_like(write), np.empty_like(state)
    step = chunks_per_group(heads, C, d_k, d_v, x.q.dtype.itemsize) * C
    for start in range(0, n * C, step):
        with clock(COPIES):
            chunks = x.chunks(C, start, min(start + step, n * C))
        with clock(ELEMENTWISE):
            chunks = chunks.prepared(prep)
        terms = terms_copy(chunks, clock)
        for c in range(terms.u.shape[1]):
            first = start + c * C
            last = min(C, T - first)
            with clock(MATMULS):
                np.matmul(terms.wq[:, c], state, out=read)  # (N, 2C, d_v): [W S; e^γ q S]
            with clock(ELEMENTWISE):
                np.subtract(terms.u[:, c], read[:, :C], out=write)  # u = U − W S
            with clock(MATMULS):
                np.matmul(terms.p[:, c], write, out=products)  # P u
            with clock(ELEMENTWISE):
                np.add(read[:, C : C + last], products[:, :last], out=out[:, first : first + last])
                state *= terms.chunk_decay[:, c]
            with clock(MATMULS):
                np.matmul(terms.k_to_end_t[:, c], write, out=update)
            with clock(ELEMENTWISE):
                state += update
    return out, state


def terms_copy(x: Tokens, clock: Any) -> ChunkTerms:
    """_linear_kernel.chunk_terms for one decay a head (decayed_products' lines inlined), each line timed."""
    C = x.q.shape[-2]
    with clock(ELEMENTWISE):
        gamma = np.cumsum(x.g, axis=-2)  # (N, n, C, 1)
        decay = np.exp(gamma)
    with clock(COPIES):
        k_t = _t(x.k)  # (N, n, d_k, C)
    with clock(ELEMENTWISE):
        pairwise = _pairwise_decay(gamma[..., 0], strict=False)  # (N, n, C, C)
    decayed = []
    for left in (x.k, x.q):
        with clock(MATMULS):
            product = left @ k_t
        with clock(ELEMENTWISE):
            decayed.append(np.multiply(product, pairwise, out=np.empty_like(pairwise)))
    a, p = decayed
    with clock(ELEMENTWISE):
        a *= x.beta[..., :, None]
        v_beta = x.v * x.beta[..., None]
    with clock(INVERSE):
        inverse = invert_unit_lower(a)
    with clock(MATMULS):
        u = inverse @ v_beta
    with clock(COPIES):
        wq = np.empty((*x.q.shape[:-2], 2 * C, x.q.shape[-1]), x.q.dtype)  # (N, n, 2C, d_k)
    with clock(ELEMENTWISE):
        k_beta = x.k * (x.beta[..., None] * decay)
    with clock(MATMULS):
        np.matmul(inverse, k_beta, out=wq[..., :C, :])
    with clock(ELEMENTWISE):
        np.multiply(x.q, decay, out=wq[..., C:, :])
        k_to_end = x.k * np.exp(gamma[..., -1:, :] - gamma)
    with clock(COPIES):
        k_to_end_t = _t(k_to_end)
    return ChunkTerms(gamma, inverse, u, wq, p, k_to_end_t, decay[..., -1, :, None])
