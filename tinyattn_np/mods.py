"""Mods: an attention pattern as a plain function of positions (torch's FlexAttention, in NumPy).

    mask_mod(b, h, q_idx, kv_idx) -> bool           True where query q_idx of head h in batch entry b may see key kv_idx
    score_mod(score, b, h, q_idx, kv_idx) -> score  the score rewritten (a bias added, a cap applied), before softmax

    attention = softmax(where(mask_mod, score_mod(Q Kᵀ · scale), -inf)) V

b, h, q_idx and kv_idx are NumPy integer arrays that broadcast against the scores (one tile of them, or all),
and a mod is called once per tile with all of them at once, never once per score. So a mod written with
operations NumPy and torch share (comparisons, &, |, arithmetic, indexing a table by h) runs unchanged in
torch.nn.attention.flex_attention, which calls it on 0-d tensors:

    def sliding_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 1024)

h is the query head; with grouped-query heads, query head h reads kv head h // (Hq // Hkv).

The ready-made mods, each from its source:
    causal_mod, sliding_window_mod      the causal mask in both alignments, a sliding window (masks.py)
    prefix_lm_mod                       a bidirectional prefix, then causal (Raffel et al. 2020, T5's prefix LM)
    document_mod, varlen_mod            packed documents see only their own (FlashAttention's varlen cu_seqlens)
    Alibi                               -slope_h · |i + S - L - j| (Press et al. 2022; FlashAttention's alibi_slopes)
    Softcap                             cap · tanh(score / cap) (Gemma 2, Gemma Team 2024)
    RelativeBias                        a learned bias per head and relative distance (Shaw et al. 2018; T5)

Read it in this order: the mask mods (causal_band first: masks.py's band as a function), the score mods, then
create_mask, a mod as the dense mask it stands for. Each ready-made score mod also carries its derivative
(derivative, param_grad) for the backward: mod_grads.py, after the backward, derives what it does with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._checks import (
    check_count,
    check_cu_seqlens,
    check_positive_int,
    check_window,
    check_window_is_causal,
    plain_array,
)
from ._guard import refuse_unless_fits
from ._mod_calls import MaskMod, modded, name_of, positional_arguments, score_indices, visible
from .masks import causal_offset

__all__ = [
    "Alibi",
    "RelativeBias",
    "Softcap",
    "alibi_slopes",
    "and_masks",
    "causal_band",
    "causal_mod",
    "create_mask",
    "document_ids",
    "document_mod",
    "noop_mask",
    "or_masks",
    "prefix_lm_mod",
    "sliding_window_mod",
    "varlen_mod",
]


# ---------------------------------------------------------------------------------------------------
# mask mods: which keys each query sees


def causal_band(offset: int, window: int | None = None) -> MaskMod:
    """The causal band as a mask_mod: query i sees key j when j <= i + offset, and with a window also
    j > i + offset - window (masks.py draws both). blockmask.Band's partial tiles use exactly this."""

    def band(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = kv_idx <= q_idx + offset
        return allowed if window is None else allowed & (kv_idx > q_idx + offset - window)

    band.__name__ = f"causal_band(offset={offset}" + ("" if window is None else f", window={window}") + ")"
    return band


def causal_mod(n_q: int, n_k: int | None = None, *, align: str = "bottom_right") -> MaskMod:
    """The causal mask of masks.causal_mask as a mask_mod: bottom-right (j <= i + S - L) or top-left (j <= i)."""
    n_q, n_k = check_count(n_q, "n_q"), check_count(n_q if n_k is None else n_k, "n_k")
    return causal_band(causal_offset(n_q, n_k, align))


def sliding_window_mod(window: int, n_q: int, n_k: int | None = None, *, align: str = "bottom_right") -> MaskMod:
    """masks.window_mask as a mask_mod: query i sees itself and the window - 1 keys before it (Mistral;
    FlashAttention's window_size=(w, 0) is window = w + 1)."""
    n_q, n_k = check_count(n_q, "n_q"), check_count(n_q if n_k is None else n_k, "n_k")
    return causal_band(causal_offset(n_q, n_k, align), check_window(window, n_q, n_k))


def noop_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
    """Every query sees every key (torch's noop_mask)."""
    return np.ones(np.broadcast_shapes(*(np.shape(x) for x in (b, h, q_idx, kv_idx))), bool)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that lets a key through where every one of mask_mods does (torch's and_masks)."""

    def both(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = noop_mask(b, h, q_idx, kv_idx)
        for mod in mask_mods:
            allowed = allowed & visible(mod, b, h, q_idx, kv_idx)
        return allowed

    both.__name__ = "and_masks(" + ", ".join(name_of(mod) for mod in mask_mods) + ")"
    return both


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that lets a key through where any one of mask_mods does (torch's or_masks)."""

    def either(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = ~noop_mask(b, h, q_idx, kv_idx)
        for mod in mask_mods:
            allowed = allowed | visible(mod, b, h, q_idx, kv_idx)
        return allowed

    either.__name__ = "or_masks(" + ", ".join(name_of(mod) for mod in mask_mods) + ")"
    return either


def prefix_lm_mod(prefix: Any) -> MaskMod:
    """Prefix-LM (Raffel et al. 2020, T5): every query sees the first `prefix` keys, and the rest causally
    (top-left, j <= i: self-attention). prefix: an int, or one per batch entry, shape (B,); the mod keeps
    its own copy (changing the caller's array afterwards changes nothing)."""
    prefix = np.array(plain_array(prefix, "prefix"))  # a copy
    if prefix.dtype.kind not in "iu" or prefix.ndim > 1 or (prefix < 0).any():
        raise ValueError(f"prefix must be an int >= 0 or a (B,) array of them; got {prefix!r}")

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        length = prefix if prefix.ndim == 0 else prefix[checked_index(b, prefix.size, "prefix", "batch entry")]
        return (kv_idx < length) | (kv_idx <= q_idx)

    return prefix_lm


def document_ids(cu_seqlens: Any, name: str = "cu_seqlens") -> np.ndarray:
    """The document of every packed token, from FlashAttention's cu_seqlens (0, n_0, n_0 + n_1, ..., total):
    cu_seqlens = [0, 3, 5] -> [0, 0, 0, 1, 1]."""
    cu = check_cu_seqlens(cu_seqlens, name)
    return np.repeat(np.arange(cu.size - 1), np.diff(cu))  # (total,)


def document_mod(q_documents: Any, kv_documents: Any = None) -> MaskMod:
    """Document masking for packed sequences (torch's FlexAttention examples): a query sees only the keys
    of its own document. q_documents: the document id of every query, (L,) or one row per batch entry
    (B, L); kv_documents the same for the keys (default: q_documents, self-attention). and_masks it with
    causal_mod for causal documents; varlen_mod does both from cu_seqlens. The mod keeps its own copies of
    the ids, and refuses a query, key or batch entry past their end."""
    q_doc = np.array(plain_array(q_documents, "q_documents"))  # copies: the caller's arrays may change
    kv_doc = q_doc if kv_documents is None else np.array(plain_array(kv_documents, "kv_documents"))
    for name, ids in (("q_documents", q_doc), ("kv_documents", kv_doc)):
        if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
            raise ValueError(f"{name} must be ints of shape (L,) or (B, L); got {ids.dtype} of shape {ids.shape}")

    def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_ids = document_of(q_doc, b, q_idx, "q_documents", "query")
        return q_ids == document_of(kv_doc, b, kv_idx, "kv_documents", "key")

    return document


def document_of(ids: np.ndarray, b: Any, idx: Any, name: str, what: str) -> np.ndarray:
    """ids[idx], or ids[b, idx] for one row per batch entry: the documents of positions idx, refusing a
    position or a batch entry that ids has no id for (NumPy's IndexError would not name them)."""
    if np.size(idx) and int(np.max(idx)) >= ids.shape[-1]:
        raise ValueError(
            f"{name} has {ids.shape[-1]} ids, but the mask is asked about {what} {int(np.max(idx))}: give one "
            f"document id per {what}, shape (L,) or (B, L)"
        )
    return ids[idx] if ids.ndim == 1 else ids[checked_index(b, ids.shape[0], name, "batch entry"), idx]


def checked_index(index: Any, size: int, name: str, what: str) -> Any:
    """index (a batch entry b or a head h, an int or an array of them), after checking that `name`, which
    has one row per batch entry or head, has `size` > index of them."""
    if np.size(index) and int(np.max(index)) >= size:
        raise ValueError(
            f"{name} has {size} rows, one per {what}, but the mod is asked about {what} {int(np.max(index))}: "
            f"give one row per {what} of the inputs"
        )
    return index


def varlen_mod(cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False, window: int | None = None) -> MaskMod:
    """FlashAttention's varlen mask: packed sequences, each attending only to its own keys, and with causal
    bottom-right within its own sequence (query i of a sequence of L_d queries and S_d keys sees its
    keys j <= i + S_d - L_d), as flash_attn_varlen_func does; window as in sliding_window_mod."""
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q"), check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.size != cu_k.size:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must count the same sequences; got {cu_q.size - 1} and {cu_k.size - 1}"
        )
    check_window_is_causal(window, causal)
    width = None if window is None else check_window(window, int(cu_q[-1]), int(cu_k[-1]))
    q_doc, kv_doc = document_ids(cu_q, "cu_seqlens_q"), document_ids(cu_k, "cu_seqlens_k")
    ends_q, ends_k = cu_q[1:], cu_k[1:]
    same_document = document_mod(q_doc, kv_doc)
    if not causal:
        return same_document

    def varlen(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        doc = q_doc[q_idx]
        # positions counted back from each sequence's end: bottom-right alignment within the sequence
        i, j = q_idx - ends_q[doc], kv_idx - ends_k[doc]
        allowed = same_document(b, h, q_idx, kv_idx) & (j <= i)
        return allowed if width is None else allowed & (j > i - width)

    return varlen


# ---------------------------------------------------------------------------------------------------
# score mods, each with its derivative for the backward (mod_grads.py)


def combine(op: Any, score: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """op(score, bias), written into bias when it already has the result's size: the mod then makes one array
    of the scores' size, not two (the reference's (L, S) scores are large)."""
    shape = np.broadcast_shapes(score.shape, bias.shape)
    if bias.size != math.prod(shape) or bias.dtype != np.result_type(score, bias):
        return np.asarray(op(score, bias))
    into = bias.reshape(shape)  # a view: bias is a new, contiguous array
    return np.asarray(op(score, into, out=into))


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi's head slopes (Press et al. 2022): for n a power of 2 the geometric sequence 2^(-8/n), 2^(-16/n),
    ..., 2^(-8); otherwise those of the power of 2 below n, then every other slope of twice that power
    (the paper's code). n_heads = 8: 1/2, 1/4, ..., 1/256. float64, shape (n_heads,)."""
    n = check_positive_int(n_heads, "n_heads")
    power = 2 ** int(math.floor(math.log2(n)))
    slopes = 2.0 ** (-8.0 * np.arange(1, power + 1) / power)  # (power,)
    extra = 2.0 ** (-8.0 * np.arange(1, 2 * power + 1, 2) / (2 * power))  # every other slope of 2·power heads
    return np.concatenate([slopes, extra[: n - power]])  # (n_heads,)


class Alibi:
    """ALiBi (Press et al. 2022, "Train Short, Test Long"), aligned as FlashAttention's alibi_slopes:

        new = score - slope_h · |i + S - L - j|        (query i of L, key j of S: bottom-right)

    slopes: (Hq,) or (B, Hq) per batch entry, alibi_slopes(Hq) for the paper's. learned=True makes the (Hq,)
    slopes parameters: the backward returns ∂loss/∂slope_h = Σ_ij dnew_ij · (-|i + S - L - j|). The mod
    holds its own float64 copy of the slopes: params is that copy (an optimiser updates it in place).
    """

    def __init__(self, slopes: Any, n_q: int, n_k: int | None = None, *, learned: bool = False):
        self.slopes = np.array(plain_array(slopes, "slopes"), dtype=np.float64)  # a copy
        if self.slopes.ndim not in (1, 2) or not np.isfinite(self.slopes).all():
            raise ValueError(f"slopes must be finite, shape (Hq,) or (B, Hq); got shape {self.slopes.shape}")
        if learned and self.slopes.ndim != 1:
            raise ValueError(f"learned slopes must have shape (Hq,), one per head; got {self.slopes.shape}")
        self.offset = causal_offset(check_count(n_q, "n_q"), check_count(n_q if n_k is None else n_k, "n_k"))
        self.params = self.slopes if learned else None

    def __repr__(self) -> str:
        return f"Alibi(slopes of shape {self.slopes.shape}, offset={self.offset}, learned={self.params is not None})"

    def distance(self, q_idx: Any, kv_idx: Any, dtype: Any) -> np.ndarray:
        """|i + S - L - j| in the scores' dtype (int64 times float32 would compute in float64), made once at
        the broadcast shape of q_idx and kv_idx, then turned into its absolute value in place."""
        distance = np.asarray(q_idx + self.offset, dtype=dtype) - np.asarray(kv_idx, dtype=dtype)
        return np.abs(distance, out=distance)

    def slope(self, b: Any, h: Any, dtype: Any) -> np.ndarray:
        h = checked_index(h, self.slopes.shape[-1], "slopes", "query head")
        if self.slopes.ndim == 1:
            return self.slopes[h].astype(dtype)
        return self.slopes[checked_index(b, self.slopes.shape[0], "slopes", "batch entry"), h].astype(dtype)

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        bias = self.slope(b, h, score.dtype) * self.distance(q_idx, kv_idx, score.dtype)
        return combine(np.subtract, score, bias)  # score - slope_h · |i + S - L - j|

    def derivative(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> None:
        return None  # a bias: ∂new/∂score = 1

    def param_grad(self, dnew: np.ndarray, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        """∂loss/∂slope_h from one block of dnew = ∂loss/∂new for head h: Σ dnew · (-|i + S - L - j|)."""
        return np.asarray(-np.sum(dnew * self.distance(q_idx, kv_idx, dnew.dtype), dtype=np.float64))


class Softcap:
    """Logit soft-capping (Gemma 2, Gemma Team 2024; attention cap 50): new = cap · tanh(score / cap), so
    that no score leaves (-cap, cap). Its derivative: ∂new/∂score = 1 - tanh²(score / cap).

    cap: a positive finite number (no cap at all is score_mod=None). As the cap grows, cap · tanh(score / cap)
    tends to the score itself (tanh x ≈ x for small x): a cap past the compute dtype's range (1e39 in
    float32) is applied in float64, so that the scores come back all but unchanged, never NaN.
    """

    params = None

    def __init__(self, cap: float):
        if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (int, float, np.floating, np.integer)):
            raise TypeError(f"cap must be a positive number; got {cap!r} ({type(cap).__name__})")
        try:
            self.cap = float(cap)
        except OverflowError:  # an int such as 10**400 has no float
            raise ValueError("cap must be a positive finite number; got an int too large for a float") from None
        if not self.cap > 0 or not math.isfinite(self.cap):
            no_cap = ": an infinite cap leaves every score as it is, which score_mod=None does" if self.cap > 0 else ""
            raise ValueError(f"cap must be a positive finite number; got {cap!r}{no_cap}")

    def __repr__(self) -> str:
        return f"Softcap({self.cap:g})"

    def tanh_of(self, score: np.ndarray) -> np.ndarray:
        """tanh(score / cap), a new array, in the scores' dtype or in float64 when the cap overflows it."""
        dtype = score.dtype if self.cap <= float(np.finfo(score.dtype).max) else np.float64
        t = np.divide(score, self.cap, dtype=dtype)
        return np.tanh(t, out=t)

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        new = self.tanh_of(score)
        new *= self.cap
        return new.astype(score.dtype, copy=False)

    def derivative(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        t = self.tanh_of(score)
        return (1.0 - t * t).astype(score.dtype, copy=False)


class RelativeBias:
    """A learned bias per head and relative position, read from a table (Shaw et al. 2018 clip the distance;
    T5, Raffel et al. 2020, buckets it):

        new = score + table[h, bucket(j - (i + S - L))]

    table: (Hq, R). bucket: a function of the signed distance j - i' (an int array, 0 on the bottom-right
    diagonal) to table columns 0 .. R - 1; by default the distance clipped to ±(R - 1) / 2, shifted to
    0 .. R - 1 (R odd). learned=True (the default) makes the table a parameter: the backward returns
    ∂loss/∂table[h, r] = Σ of dnew over the scores of head h in bucket r. The mod holds its own float64
    copy of the table: params is that copy (an optimiser updates it in place).
    """

    def __init__(self, table: Any, n_q: int, n_k: int | None = None, *, bucket: Any = None, learned: bool = True):
        self.table = np.array(plain_array(table, "table"), dtype=np.float64)  # a copy
        if self.table.ndim != 2 or self.table.shape[1] < 1 or not np.isfinite(self.table).all():
            raise ValueError(f"table must be finite numbers of shape (Hq, R); got shape {self.table.shape}")
        if bucket is None and self.table.shape[1] % 2 == 0:
            raise ValueError(f"the default bucket clips to ±(R - 1)/2: R must be odd; got R = {self.table.shape[1]}")
        self.bucket = bucket if bucket is not None else self.clipped
        self.offset = causal_offset(check_count(n_q, "n_q"), check_count(n_q if n_k is None else n_k, "n_k"))
        self.params = self.table if learned else None

    def __repr__(self) -> str:
        return f"RelativeBias(table of shape {self.table.shape}, offset={self.offset})"

    def clipped(self, distance: np.ndarray) -> np.ndarray:
        """The default bucket: the distance clipped to ±reach, shifted to 0 .. 2·reach, in place."""
        reach = (self.table.shape[1] - 1) // 2
        np.clip(distance, -reach, reach, out=distance)
        distance += reach
        return distance

    def columns(self, q_idx: Any, kv_idx: Any) -> np.ndarray:
        """The table column of each (query, key): bucket(j - (i + S - L)), checked to lie in the table."""
        distance = np.asarray(kv_idx, np.int32) - np.asarray(q_idx + self.offset, np.int32)  # half int64's bytes
        column = np.asarray(self.bucket(distance))
        if column.dtype.kind not in "iu" or column.size and not 0 <= column.min() <= column.max() < self.table.shape[1]:
            raise ValueError(f"bucket must give table columns 0 .. {self.table.shape[1] - 1}; got {column.dtype}")
        return column

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        h = checked_index(h, self.table.shape[0], "table", "query head")
        return combine(np.add, score, self.table.astype(score.dtype)[h, self.columns(q_idx, kv_idx)])

    def derivative(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> None:
        return None  # a bias: ∂new/∂score = 1

    def param_grad(self, dnew: np.ndarray, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        """∂loss/∂table[h] (R,) from one block of dnew for head h: dnew summed by bucket."""
        columns = np.broadcast_to(self.columns(q_idx, kv_idx), dnew.shape)
        return np.bincount(columns.ravel(), weights=dnew.ravel(), minlength=self.table.shape[1])


# ---------------------------------------------------------------------------------------------------
# a mod as the dense mask it stands for


def create_mask(
    mod_fn: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device: Any = None
) -> np.ndarray:
    """The dense (B, H, Q_LEN, KV_LEN) bool mask of a mod, as torch's create_mask: a mask_mod (4 arguments)
    gives where it lets a key through, a score_mod (5) where it leaves a score of 0 finite (not -inf).
    B, H = None count as 1. It holds L x S entries per (b, h): for checking and small cases;
    create_block_mask never builds it."""
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None or 'cpu': NumPy runs on the CPU; got {device!r}")
    B, H = (1 if n is None else check_positive_int(n, name) for n, name in ((B, "B"), (H, "H")))
    n_q, n_k = check_count(Q_LEN, "Q_LEN"), check_count(KV_LEN, "KV_LEN")
    # the mask, and what the mod makes on the way: two bool arrays of its size, or a score_mod's two of float64
    per_entry = 3 if positional_arguments(mod_fn) != 5 else 2 * 8 + 3
    refuse_unless_fits(
        B * H * n_q * n_k * per_entry,
        "create_mask()",
        f"a ({B}, {H}, {n_q}, {n_k}) mask",
        "lower B, H or the lengths; create_block_mask gives the tiles without it",
    )
    b, h, q_idx, kv_idx = score_indices((B,), H, n_q, n_k)
    if positional_arguments(mod_fn) == 5:  # a score_mod: the scores it does not hide
        allowed = ~np.isneginf(modded(mod_fn, np.zeros((B, H, n_q, n_k)), b, h, q_idx, kv_idx))
    else:
        allowed = visible(mod_fn, b, h, q_idx, kv_idx)
    return np.broadcast_to(allowed, (B, H, n_q, n_k)).copy()
