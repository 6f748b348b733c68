"""The KV cache: keep each token's keys and values so that a decode step computes only the new token's.

Without a cache, step t of generation recomputes k and v of all t tokens and attends t x t: the work
of generating T tokens grows like T³ (T² per step for the scores). With one, step t computes k and v of
the one new token, appends them, and attends 1 x t: the scores grow like T² in total. The cache itself is
two preallocated arrays and a slice assignment into each (llama's model.py does the same), for T new tokens
at positions start .. start + T - 1:

    cache_k[:, :, start : start + T] = k           k (B, Hkv, T, E) into cache_k (B, Hkv, max_tokens, E)
    cache_v[:, :, start : start + T] = v
    keys, values = cache_k[:, :, : start + T], cache_v[:, :, : start + T]     what the new queries attend to

It holds

    bytes = 2 (k and v) · batch · kv_heads · head_dim · tokens · bytes_per_element        (per layer)

which is memory.kv_cache_bytes(tokens, layers=1, ...). Grouped-query attention shrinks it by Hq / Hkv.

Values that are part of the keys: multi-head latent attention (latent.py) caches one latent a token, the key
[c_KV | k_rope], whose first kv_lora_rank numbers are also the value. KVCache(..., value_prefix=r) stores the
keys only, and its values are a view of the keys' first r numbers: the latent is held once,

    bytes = batch · kv_heads · head_dim · tokens · bytes_per_element                       (value_prefix=r)

which is memory.latent_cache_bytes(tokens, layers=1, ...) for one kv head of r + d_rope numbers.

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

A layer decodes through the cache with `attend` (MultiHeadAttention(x, cache=c) calls c.attend(layer, x)):
the new tokens' q, k and v at positions len(c) onwards, k and v appended, and the new queries against every
kept key. A one-token step is split-KV decoding (splitkv.py): one query has no query blocks to spread over
the cores, so the keys are split instead. A layer whose queries choose which keys they read (dsa.py's DSA
layer: _paged_kernel.ChoosingLayer) reads them itself: the cache writes the new tokens, hands the layer its
rows as a paged kernel reads a pool (paged.py, next: here a block of max_tokens slots a row), and commits.

All or nothing: `append` writes the new tokens' slots, then counts them with one assignment (the commit);
an exception before it (a Ctrl-C at any bytecode) puts the slots back as they were (_atomic.py). `attend`
writes the new tokens, attends, then commits, so an interrupted step leaves the cache as it was.

Threads: `append` is atomic. It holds the cache's lock from the room check to the count update, so appends
from several threads all land (in some order), each token's k and v in the same slot, and one that does
not fit is refused whole. `attend` holds the lock from reading len(cache) to its append, so the positions
RoPE turns by are the ones the tokens get. Reading does not take the lock: see `KVCache`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from ._atomic import Undo, holding
from ._cache_buffers import (
    CopiedWithoutLock,
    KeysAndValues,
    check_cache_dtype,
    check_value_prefix,
    check_values_are_prefix,
    read_only_view,
    refuse_cache_beyond_memory,
)
from ._checks import check_bool, check_count, check_positive_int
from ._paged_kernel import ChoosingLayer, Pages
from .blockmask import Band, check_band
from .multihead import DecodingLayer, check_decoding_layer
from .splitkv import flash_decode

R = TypeVar("R")

Array = NDArray[np.floating]

__all__ = ["KVCache"]


class KVCache(CopiedWithoutLock, KeysAndValues):
    """Preallocated keys and values for one attention layer: (batch, kv_heads, slots, head_dim) each.

    max_tokens: how many tokens this cache accepts in all (the model's context); an append past it is
    refused. window=None keeps every token (slots = max_tokens); window=W keeps the last W in a ring
    buffer (slots = min(W, max_tokens)). dtype: float16, float32 or float64, the dtype k and v must have.
    value_prefix=None: values of their own, as wide as the keys; value_prefix=r: each token's value is the
    first r numbers of its key (multi-head latent attention's latent), so only the keys are stored, `values`
    is a view of them (batch, kv_heads, kept, r), and append takes v equal to k[..., :r].

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
        *,
        value_prefix: int | None = None,
    ):
        self.batch = check_positive_int(batch, "batch")
        self.kv_heads = check_positive_int(kv_heads, "kv_heads")
        self.max_tokens = check_positive_int(max_tokens, "max_tokens")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.window = None if window is None else check_positive_int(window, "window")
        self.dtype = check_cache_dtype(dtype)
        self.value_prefix = check_value_prefix(value_prefix, self.head_dim)
        self.slots = self.max_tokens if self.window is None else min(self.window, self.max_tokens)
        shape = (self.batch, self.kv_heads, self.slots, self.head_dim)
        change = "lower max_tokens or batch, or keep a window="
        refuse_cache_beyond_memory("KVCache", shape, self.dtype, change, value_prefix=self.value_prefix)
        self._k = np.zeros(shape, self.dtype)  # (B, Hkv, slots, E): preallocated once, never grown
        # (B, Hkv, slots, Ev), or None: the values are the keys' first value_prefix numbers (see _values)
        self._v = np.zeros(shape, self.dtype) if self.value_prefix is None else None
        self._seen = 0  # tokens appended so far: the one number a change commits
        self.lock = threading.RLock()  # held by append (and ordered): check, write and count as one step

    def __len__(self) -> int:
        """Tokens seen so far (with a window, more than the cache still holds once it has wrapped)."""
        return self._seen

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        prefix = "" if self.value_prefix is None else f", value_prefix={self.value_prefix}"
        return (
            f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_tokens={self.max_tokens}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}{window}{prefix}; {self._seen} tokens seen)"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated k and v: memory.kv_cache_bytes(max_tokens, layers=1, ...); with value_prefix,
        of the keys alone (memory.latent_cache_bytes for one kv head)."""
        return int(self._k.nbytes + (0 if self._v is None else self._v.nbytes))

    @property
    def kept(self) -> int:
        """Tokens attention may see now: all seen, or the last `window` of them."""
        return min(self._seen, self.slots)

    def _check(self, x: Any, name: str, width: int) -> np.ndarray:
        """x must be an ndarray (batch, kv_heads, T_new, width) of this cache's dtype."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array; got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"{name} must have this cache's dtype {self.dtype}; got {x.dtype}")
        what = "head_dim" if width == self.head_dim else "value_prefix"
        if x.ndim != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (self.batch, self.kv_heads, width):
            raise ValueError(
                f"{name} must have shape ({self.batch}, {self.kv_heads}, T_new, {width}) "
                f"(batch, kv_heads, T_new, {what}); got {x.shape}"
            )
        return x

    def _check_pair(self, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        """k and v checked: arrays (batch, kv_heads, T_new, head_dim or value_dim) of this cache's dtype, of one
        T_new; with value_prefix, v equal to k's first value_prefix numbers."""
        k, v = self._check(k, "k", self.head_dim), self._check(v, "v", self.value_dim)
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must have the same number of tokens; got shapes {k.shape} and {v.shape}")
        check_count(k.shape[2], "T_new")
        check_values_are_prefix(k, v, self.value_prefix)
        return k, v

    def append(self, k: Array, v: Array) -> None:
        """Add T_new tokens: k (batch, kv_heads, T_new, head_dim) and v (batch, kv_heads, T_new, value_dim),
        already rotated by RoPE. With value_prefix, v must be k[..., :value_prefix]; only k is written.

        Every check runs before anything is written, so a refused append leaves the cache as it was, and
        so does an interrupted one (all or nothing: see _append). Atomic under threads: the room check, both
        writes and the count run under `self.lock`, so two appends never take the same slots and no slot
        holds the k of one token and the v of another.
        """
        k, v = self._check_pair(k, v)  # no lock needed: they are the caller's
        holding(self.lock, self._append, k, v)

    def append_and_read(self, k: Array, v: Array, read: Callable[[Array, Array], R]) -> R:
        """append(k, v), with read(keys, values) run before the append commits, on read-only views of every
        kept token with the new ones written (in slot order); returns what read returns. An exception in read
        (a refusal, a Ctrl-C) leaves the cache as it was: the new tokens are both attended to and kept, or
        neither. (attend's own steps do the same for MultiHeadAttention.)"""
        k, v = self._check_pair(k, v)

        def read_written(stop: int) -> R:
            return read(self._view(self._k, stop), self._view(self._values, stop))

        return holding(self.lock, self._append, k, v, read_written)

    def _room_for(self, t_new: int) -> int:
        """len(self) + t_new, if that many tokens fit; else the ValueError that says how many do."""
        if self._seen + t_new > self.max_tokens:
            raise ValueError(
                f"k has {t_new} new tokens but the cache holds {self._seen} of max_tokens={self.max_tokens}: "
                f"only {self.max_tokens - self._seen} more fit"
            )
        return self._seen + t_new

    def _append(self, k: np.ndarray, v: np.ndarray, before_commit: Callable[[int], Any] = lambda stop: None) -> Any:
        """Under the lock: 1) the room check, 2) k and v written to their slots, saving what was there,
        3) before_commit(stop) (attend's attention over the written slots), 4) the commit, len(self) = stop,
        one assignment. An exception before it puts the slots back. Returns before_commit's result."""
        start, stop = self._seen, self._room_for(k.shape[2])
        undo = Undo()
        try:
            # token p goes to slot p (no window) or p mod W (ring). Of a continuation longer than the ring,
            # only its last `slots` tokens survive, so only those are written.
            first = max(start, stop - self.slots)
            slots = (slice(None), slice(None), np.arange(first, stop) % self.slots)  # (kept new tokens,)
            undo.write(self._k, slots, k[:, :, first - start :])  # (B, Hkv, kept, E)
            if self._v is not None:  # else the values are the keys' prefix, written with them
                undo.write(self._v, slots, v[:, :, first - start :])  # (B, Hkv, kept, Ev)
            result = before_commit(stop)
            self._seen = stop  # the commit
        except BaseException:
            if self._seen != stop:
                undo.undo()
            raise
        return result

    def _view(self, buf: np.ndarray, seen: int | None = None) -> np.ndarray:
        """buf's slots of the first `seen` tokens (default len(self)), read-only: writing to a view into the
        cache would corrupt it. (B, Hkv, kept, E): before the ring wraps, slots are in token order."""
        kept = min(self._seen if seen is None else seen, self.slots)
        return read_only_view(buf[:, :, :kept])

    @property
    def keys(self) -> Array:
        """Read-only view (batch, kv_heads, kept, head_dim) of the keys attention may see, in slot order."""
        return self._view(self._k)

    @property
    def values(self) -> Array:
        """Read-only view (batch, kv_heads, kept, value_dim) of the values, in the same order as keys (with
        value_prefix, a view of the keys' first value_prefix numbers: the same memory)."""
        return self._view(self._values)

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
        return holding(self.lock, self._ordered)

    def _ordered(self) -> tuple[Array, Array]:
        if self._seen <= self.slots:
            return self.keys, self.values
        order = np.argsort(self.positions)  # (kept,): slots sorted by the position they hold
        keys = self._k[:, :, order]  # (B, Hkv, kept, E), a copy
        values = keys[..., : self.value_prefix] if self._v is None else self._v[:, :, order]  # (B, Hkv, kept, Ev)
        return keys, values

    # --- a layer's decoding through this cache: MultiHeadAttention(x, cache=self) --------------------

    def attend(self, layer: DecodingLayer, x: Array, *, fused: bool = True, seq_ids: Any = None) -> Array:
        """x (B, T, d_model), the next T tokens of the B sequences this cache holds, through layer's heads
        -> y (B, H, T, Ev), the heads' attention before layer's output projection; x's k and v appended.

        layer: a MultiHeadAttention, or any DecodingLayer (multihead.py): the layer makes the heads
        (split_heads) and their attention (attend_heads), the cache the positions, the keys and the decoding.
        The tokens sit at absolute positions len(self) .. len(self) + T - 1 (RoPE turns them by those) and
        attend causally to every kept key: bottom-right, so a one-token step (T = 1) sees all of them.
        fused=True: flash attention, and split-KV (flash_decode) for a one-token step; fused=False: the
        layer's reference. seq_ids: None (a KVCache holds one sequence per row of x; a PagedKVCache takes seq_ids).
        A layer that chooses which tokens its queries read (_paged_kernel.ChoosingLayer) reads them itself,
        the new ones written first and committed after its read; fused does not apply. The lock is held
        from reading len(self) to the append: threads decoding into one cache each get positions of their
        own. An append that does not fit is refused, and the cache stays as it was.
        """
        if seq_ids is not None:
            raise ValueError("seq_ids is for a PagedKVCache; a KVCache holds one sequence per row of x: drop it")
        check_decoding_layer(layer)
        x = layer.check_cache(self, x)  # (B, T, d_model) in layer's dtype, once this cache fits it
        fused = check_bool(fused, "fused")
        return holding(self.lock, self._attend, layer, x, fused)

    def _attend(self, layer: DecodingLayer, x: Array, fused: bool) -> Array:
        """attend under the lock: the length read here is the one the append continues."""
        # 1) q, k, v of the new tokens, turned by RoPE at their absolute positions start .. start + T - 1
        start, T = len(self), x.shape[1]
        q, k, v = layer.split_heads(x, np.arange(start, start + T))
        k, v = self._check_pair(k, v)
        if isinstance(layer, ChoosingLayer):  # it reads the kept tokens itself, the new ones written first
            return self._attend_choosing(layer, q, k, v)
        # 2) a ring (window) cannot take T > 1 new tokens before they attend: the first new token still
        #    needs keys that the last ones would push out. Attend to the kept keys (in token order) plus
        #    the new ones under the band (bottom-right), then append.
        if self.window is not None and T > 1:
            self._room_for(T)  # refused before any work if they do not fit
            kept = self.kept
            refuse_cache_beyond_memory(  # the kept keys in order (a copy), then beside the new ones (another)
                "KVCache.attend",
                (self.batch, self.kv_heads, 2 * kept + T, self.head_dim),
                self.dtype,
                "pass fewer new tokens per call",
            )
            k_old, v_old = self.ordered()  # (B, Hkv, kept, d_head) each, oldest first
            k_all, v_all = np.concatenate([k_old, k], axis=2), np.concatenate([v_old, v], axis=2)
            band = check_band(True, self.window, T, k_all.shape[2])  # flash skips the tiles outside it
            y, _ = layer.attend_heads(q, k_all, v_all, band, fused)
            self._append(k, v)
            return y
        # 3) otherwise write the new tokens first, attend to all kept, then commit (refused before any write
        #    if they do not fit; an interrupt before the commit puts the slots back)
        return self._append(k, v, before_commit=lambda stop: self._attend_kept(layer, q, stop, fused))

    def _attend_choosing(self, layer: ChoosingLayer, q: Any, k: Array, v: Array) -> Array:
        """A layer whose queries choose which tokens they read (dsa.py's): the new tokens written, the layer's
        attention over the rows as pages (layer.attend_pages), then the commit. Its tokens are read by position,
        so the slots must be in token order: no window."""
        if self.window is not None:
            raise ValueError(
                f"a layer that chooses its keys reads them by position: it needs a KVCache without a "
                f"window; got window={self.window}"
            )
        return self._append(k, v, before_commit=lambda stop: layer.attend_pages(q, self._pages(stop)))

    def _pages(self, stop: int) -> Pages:
        """The rows as a paged kernel reads a pool (_paged_kernel.Pages): `batch` blocks of `slots` slots, row b
        the block of sequence b, whose table is (b,), every row holding `stop` tokens. Read-only views, (kv_heads,
        batch, slots, head_dim or value_dim)."""
        k_pool, v_pool = (read_only_view(buffer.swapaxes(0, 1)) for buffer in (self._k, self._values))
        return Pages(k_pool, v_pool, [(b,) for b in range(self.batch)], [stop] * self.batch)

    def _attend_kept(self, layer: DecodingLayer, q: Array, stop: int, fused: bool) -> Array:
        """The new tokens' queries q (B, H, T, E) against every key kept once `stop` tokens are in, in slot
        order (which softmax ignores): query i sees stop - T + i + 1 keys."""
        keys, values = self._view(self._k, stop), self._view(self._values, stop)  # (B, Hkv, kept, E or Ev)
        T = q.shape[2]
        if T == 1 and fused:  # a decode step: one query sees every kept key, split over the cores
            return cast(Array, flash_decode(q, keys, values, scale=layer.softmax_scale))
        band = Band(None) if T == 1 else check_band(True, None, T, keys.shape[2])  # query i sees start + i + 1
        return layer.attend_heads(q, keys, values, band, fused)[0]
