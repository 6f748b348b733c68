"""Boolean attention masks. True means "may attend" (torch's convention); False entries get score -inf.

Two ways to line a causal mask up when there are L queries and S keys:

    top_left      query i sees key j when j <= i                (torch's is_causal=True)
    bottom_right  query i sees key j when j <= i + (S - L)      (FlashAttention 2.1+, KV-cache decoding)

For L == S they are the same lower triangle. For L = 2, S = 5 (two new tokens after a cache of three):

    top_left      bottom_right
    1 0 0 0 0     1 1 1 1 0
    1 1 0 0 0     1 1 1 1 1

Bottom-right is what decoding needs: the last query is the newest token and sees every key.

A sliding window of w keys (Mistral, Gemma-2's local layers) keeps the causal edge and adds a second,
parallel one: query i sees key j when i + offset - w < j <= i + offset, itself and the w - 1 keys before
it. For L = S = 5 and w = 2:

    1 0 0 0 0
    1 1 0 0 0
    0 1 1 0 0
    0 0 1 1 0
    0 0 0 1 1
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._checks import check_sizes, check_window

__all__ = ["band_blocked", "causal_mask", "causal_offset", "window_mask"]

ALIGNMENTS = ("bottom_right", "top_left")


def causal_mask(n_q: int, n_k: int | None = None, *, align: str = "bottom_right") -> NDArray[np.bool_]:
    """(n_q, n_k) bool, True where query i may attend to key j: j <= i + offset (see module doc)."""
    n_q, n_k = check_sizes(n_q, n_k)
    offset = causal_offset(n_q, n_k, align)
    return ~causal_blocked(0, n_q, 0, n_k, offset)


def window_mask(n_q: int, n_k: int | None = None, *, window: int, align: str = "bottom_right") -> NDArray[np.bool_]:
    """(n_q, n_k) bool for causal sliding-window attention (Mistral, Gemma-2 local layers).

    Query i sees key j when i + offset - window < j <= i + offset: itself and the window - 1 keys
    before it. A window of n_q + n_k keys or more (any size: 2**63 too) gives the plain causal mask.
    """
    n_q, n_k = check_sizes(n_q, n_k)
    window = check_window(window, n_q, n_k)
    offset = causal_offset(n_q, n_k, align)
    rows = np.arange(n_q)[:, None] + offset  # (n_q, 1): the key position each query lines up with
    cols = np.arange(n_k)[None, :]  # (1, n_k)
    return (cols <= rows) & (cols > rows - window)  # (n_q, n_k)


def causal_offset(n_q: int, n_k: int, align: str = "bottom_right") -> int:
    """The diagonal's offset: query i sees key j when j <= i + offset (S - L bottom-right, 0 top-left)."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}; got {align!r}")
    return n_k - n_q if align == "bottom_right" else 0


def causal_blocked(q_start: int, q_stop: int, k_start: int, k_stop: int, offset: int) -> NDArray[np.bool_]:
    """True where query i (q_start <= i < q_stop) may NOT see key j (k_start <= j < k_stop): j > i + offset.

    The rows and columns are absolute positions, so a tile of a bigger matrix gets its own piece of the
    one diagonal. Shape (q_stop - q_start, k_stop - k_start).
    """
    rows = np.arange(q_start, q_stop)[:, None]  # (bq, 1)
    cols = np.arange(k_start, k_stop)[None, :]  # (1, bk)
    return cols > rows + offset  # (bq, bk)


def band_blocked(
    q_start: int, q_stop: int, k_start: int, k_stop: int, offset: int, window: int | None
) -> NDArray[np.bool_]:
    """causal_blocked, and with a window also the keys too far back: j <= i + offset - window.

    window=None is the plain causal mask. Shape (q_stop - q_start, k_stop - k_start).
    """
    blocked = causal_blocked(q_start, q_stop, k_start, k_stop, offset)  # (bq, bk)
    if window is not None:
        rows = np.arange(q_start, q_stop)[:, None]  # (bq, 1)
        cols = np.arange(k_start, k_stop)[None, :]  # (1, bk)
        blocked |= cols <= rows + offset - window  # (bq, bk)
    return blocked
