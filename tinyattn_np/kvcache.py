"""The KV cache: keep each token's keys and values so that a decode step computes only the new token's.

Without a cache, step t of generation recomputes k and v of all t tokens and attends t x t: the work
of generating T tokens grows like T³ (T² per step for the scores). With one, step t computes k and v of
the one new token, appends them, and attends 1 x t: the scores grow like T² in total, and the cache
holds

    bytes = 2 (k and v) · batch · kv_heads · head_dim · tokens · bytes_per_element        (per layer)

which is memory.kv_cache_bytes(tokens, layers=1, ...). Grouped-query attention shrinks it by Hq / Hkv.

A sliding window of W (Mistral, Gemma-2's local layers) means a query never looks further back than
W tokens, so only the last W need keeping: a ring buffer of W slots, token p going into slot p mod W.
Once the ring has wrapped, the slots are no longer in token order. That does not matter to attention:

  * the keys are stored already rotated by RoPE at their absolute position, so each key carries its
    own position, and the score q · k_p depends on it wherever k_p sits in the buffer;
  * softmax(q Kᵀ) V is a sum over keys, the same for any order of the keys as long as each v stays
    with its k (a permutation P of the rows gives softmax(q Kᵀ Pᵀ) P V = softmax(q Kᵀ) V).

So `keys` and `values` are views of the buffer in slot order, and `positions` says which absolute
position each slot holds. Where order does matter (a mask over a many-token continuation), `ordered()`
returns them oldest first.

Threads: `append` is atomic. It holds the cache's lock from the room check to the count update, so appends
from several threads all land (in some order), each token's k and v in the same slot, and one that does
not fit is refused whole. Reading does not take the lock: see `KVCache`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import ACCEPTED_DTYPES, check_count, check_positive_int

Array = NDArray[np.floating]


def check_cache_dtype(dtype: Any) -> np.dtype:
    """A cache's dtype: float16, float32 or float64 (what its k and v must have); anything else is a TypeError."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype!r}") from None
    if dtype not in ACCEPTED_DTYPES:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype}")
    return dtype


class CopiedWithoutLock:
    """copy.deepcopy and pickle for a cache that holds `self.lock` (a threading.RLock, which cannot be copied):
    everything but the lock, and the copy gets a lock of its own. Copy a cache while no other thread changes
    it: the buffers are read after __getstate__ returns."""

    lock: threading.RLock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()


class KVCache(CopiedWithoutLock):
    """Preallocated keys and values for one attention layer: (batch, kv_heads, slots, head_dim) each.

    max_tokens: how many tokens this cache accepts in all (the model's context); an append past it is
    refused. window=None keeps every token (slots = max_tokens); window=W keeps the last W in a ring
    buffer (slots = min(W, max_tokens)). dtype: float16, float32 or float64, the dtype k and v must have.

    Several threads may append at once: each append is atomic (all its tokens, each k with its v, or none),
    and len(cache) counts every token that went in. Reading does not take the lock: `keys` and `values` are
    views sized by the tokens appended when each was asked for (`positions` likewise, as a new array), so
    an append running meanwhile is not in them, and keys read just before an append may be one token
    shorter than values read just after it. Without a window the slots a view covers are never written
    again, so it stays as read; with a window a later append overwrites ring slots in place, under the
    view. To read keys and values as one consistent pair while other threads append, hold `cache.lock`
    (a re-entrant lock) and copy:
        with cache.lock:
            keys, values = cache.keys.copy(), cache.values.copy()
    `ordered()` takes the lock itself.
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_tokens: int,
        head_dim: int,
        dtype: Any = np.float32,
        window: int | None = None,
    ):
        self.batch = check_positive_int(batch, "batch")
        self.kv_heads = check_positive_int(kv_heads, "kv_heads")
        self.max_tokens = check_positive_int(max_tokens, "max_tokens")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.window = None if window is None else check_positive_int(window, "window")
        self.dtype = check_cache_dtype(dtype)
        self.slots = self.max_tokens if self.window is None else min(self.window, self.max_tokens)
        shape = (self.batch, self.kv_heads, self.slots, self.head_dim)
        self._k = np.zeros(shape, self.dtype)  # (B, Hkv, slots, E): preallocated once, never grown
        self._v = np.zeros(shape, self.dtype)  # (B, Hkv, slots, E)
        self._seen = 0  # tokens appended so far
        self.lock = threading.RLock()  # held by append (and ordered): check, write and count as one step

    def __len__(self) -> int:
        """Tokens seen so far (with a window, more than the cache still holds once it has wrapped)."""
        return self._seen

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (
            f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_tokens={self.max_tokens}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}{window}; {self._seen} tokens seen)"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated k and v: memory.kv_cache_bytes(max_tokens, layers=1, ...)."""
        return int(self._k.nbytes + self._v.nbytes)

    @property
    def kept(self) -> int:
        """Tokens attention may see now: all seen, or the last `window` of them."""
        return min(self._seen, self.slots)

    def _check(self, x: Any, name: str) -> np.ndarray:
        """x must be an ndarray (batch, kv_heads, T_new, head_dim) of this cache's dtype."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array; got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"{name} must have this cache's dtype {self.dtype}; got {x.dtype}")
        want = (self.batch, self.kv_heads, self.head_dim)
        if x.ndim != 4 or (x.shape[0], x.shape[1], x.shape[3]) != want:
            raise ValueError(
                f"{name} must have shape ({self.batch}, {self.kv_heads}, T_new, {self.head_dim}) "
                f"(batch, kv_heads, T_new, head_dim); got {x.shape}"
            )
        return x

    def append(self, k: Array, v: Array) -> None:
        """Add T_new tokens: k and v (batch, kv_heads, T_new, head_dim), already rotated by RoPE.

        Every check runs before anything is written, so a refused append leaves the cache as it was.
        Atomic under threads: the room check, both writes and the count run under `self.lock`, so two
        appends never take the same slots and no slot holds the k of one token and the v of another.
        """
        # 1) check both arrays (no lock needed: they are the caller's)
        k, v = self._check(k, "k"), self._check(v, "v")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
        t_new = check_count(k.shape[2], "T_new")
        with self.lock:
            # 2) the room left, read under the lock: another thread's append may have just taken it
            if self._seen + t_new > self.max_tokens:
                raise ValueError(
                    f"k has {t_new} new tokens but the cache holds {self._seen} of max_tokens={self.max_tokens}: "
                    f"only {self.max_tokens - self._seen} more fit"
                )
            # 3) write them: token p goes to slot p (no window) or p mod W (ring). Of a continuation longer
            #    than the ring, only its last `slots` tokens survive, so only those are written.
            start, stop = self._seen, self._seen + t_new
            first = max(start, stop - self.slots)
            slots = np.arange(first, stop) % self.slots  # (kept new tokens,)
            self._k[:, :, slots] = k[:, :, first - start :]  # (B, Hkv, kept, E)
            self._v[:, :, slots] = v[:, :, first - start :]
            self._seen = stop

    def _view(self, buf: np.ndarray) -> np.ndarray:
        view = buf[:, :, : self.kept]  # (B, Hkv, kept, E): before the ring wraps, slots are in token order
        view.flags.writeable = False  # a view into the cache: writing to it would corrupt the cache
        return view

    @property
    def keys(self) -> Array:
        """Read-only view (batch, kv_heads, kept, head_dim) of the keys attention may see, in slot order."""
        return self._view(self._k)

    @property
    def values(self) -> Array:
        """Read-only view (batch, kv_heads, kept, head_dim) of the values, in the same order as keys."""
        return self._view(self._v)

    @property
    def positions(self) -> NDArray[np.int64]:
        """(kept,) absolute position of the token in each slot of keys/values: slot s holds the latest
        token p with p mod slots == s."""
        seen = self._seen  # read once: an append in another thread may change it meanwhile
        slot = np.arange(min(seen, self.slots))  # (kept,)
        newest = seen - 1  # the position of the newest token
        return newest - (newest - slot) % self.slots  # (kept,)

    def ordered(self) -> tuple[Array, Array]:
        """(keys, values) oldest token first: views before the ring wraps, a rolled copy after. Taken under
        the lock, so the two come from the same appends (the views, as `keys` does, may see later ones)."""
        with self.lock:
            if self._seen <= self.slots:
                return self.keys, self.values
            order = np.argsort(self.positions)  # (kept,): slots sorted by the position they hold
            return self._k[:, :, order], self._v[:, :, order]  # (B, Hkv, kept, E) each, copies
