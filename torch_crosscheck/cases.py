"""Every comparison torch_crosscheck makes, in one list (CASES): the tests and report.py both read it.

A case computes one thing twice from the same inputs, with tinyattn_np (NumPy) and with torch on a
device, and returns both results with the tolerance they must agree to (Outcome).

Inputs are drawn in float64 with a fixed seed per case, then rounded once, on the torch side, to the
dtype under test. tinyattn_np gets exactly the values torch holds: in float64 for float64, in float32
for float32, float16 and bfloat16. So in float16/bfloat16 both sides see identical inputs, torch
computes in the low format, we compute in float32, and the difference is torch's rounding.

Tolerances (tolerance() below) are written in units of the format's unit roundoff u = 2^-p, p the
significand bits: float64 2^-53, float32 2^-24, float16 2^-11, bfloat16 2^-8.

Kernels. A case whose torch side goes through F.scaled_dot_product_attention (Case.sdpa) runs once per
SDPA kernel of its device (KERNELS), forced with torch.nn.attention.sdpa_kernel; run_case() returns
None where torch has no such kernel for the case (torch raises "No available kernel"). On CPU torch has
two: "math", its reference in plain tensor ops, and "flash", its fused CPU kernel (SDPBackend.
FLASH_ATTENTION; 4-D inputs only). On CUDA it has four: math, mem-efficient, flash and cuDNN.

Rows that see no key. Our output there is 0 and our logsumexp -inf (the project's convention). torch's
kernels disagree with each other there (cuDNN and mem-efficient return non-zero values on CUDA), so a
case marks those rows (Outcome.unseen): they are left out of the comparison, ours must be exactly 0
(-inf) there, and what torch returned there is recorded (Outcome.torch_unseen), never failed on.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import tinyattn_np as ta

DEVICES = ("cpu", "cuda")
# the SDPA kernels torch has on each device, by the name a report row gives them
KERNELS = {"cpu": ("math", "flash"), "cuda": ("math", "mem-efficient", "flash", "cudnn")}
BACKENDS = {
    "math": SDPBackend.MATH,
    "mem-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# how torch 2.x words "this kernel does not take these inputs" (sdpa_kernel with one backend):
# "No available kernel. Aborting execution." or "No viable backend for scaled_dot_product_attention ..."
NO_KERNEL = ("No available kernel", "No viable backend")
FULL = ("float64", "float32")  # tinyattn_np computes in this very dtype
LOW = ("float16", "bfloat16")  # torch computes in this dtype, tinyattn_np in float32
ALL = FULL + LOW

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# the NumPy dtype our side computes in: bfloat16 has no NumPy dtype, and float16 is computed in
# float32 by tinyattn_np anyway (README, Conventions: dtypes), so we hand it the float32 values directly
NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float32, "bfloat16": np.float32}
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

# float64/float32: both sides round the same math in another order (BLAS blocking, tiles, torch's
# fused kernels). An attention output passes through about five rounding steps (scores, exp, row sum,
# divide, P @ V); its weights are >= 0 and sum to 1, so each step costs a few ulps of max|v|, not of the
# sum's length: measured on CPU, at most about 7 u · max|v| in every case below (T up to 4096). We allow 32:
# float32, max|v| = 3 gives 5.7e-6, under the 1e-5 this project asks of one_head.
FULL_ULPS = 32
# float16/bfloat16: our float32 result is the exact answer to within 32 float32 ulps, so the whole
# difference is torch's rounding in the format: the output once (u · |out| <= u · max|v|), the
# probabilities before P @ V in the fused kernels (u on each weight: <= u · max|v|), the scores on
# paths that keep them in the format (about u · |score| relative on each weight, |score| <~ 3 here).
# That is <~ 5 u; we allow 8 u. (Measured on CPU: at most 1.5 u.)
LOW_ULPS = 8


def tolerance(dtype: str, magnitude: float) -> float:
    """The largest max abs difference allowed between two results computed in `dtype` whose size is
    bounded by `magnitude` (max|v| for attention, max|x| for rope, max|out| for a whole module)."""
    return (FULL_ULPS if dtype in FULL else LOW_ULPS) * UNIT_ROUNDOFF[dtype] * magnitude


def max_abs_error(mine: np.ndarray, gold: np.ndarray) -> float:
    """max |mine - gold|; equal infinities (a logsumexp of -inf on both sides) count as 0, and a NaN
    or an infinity on one side only counts as inf, so that it fails every tolerance."""
    if mine.shape != gold.shape:
        raise ValueError(f"shapes differ: mine {mine.shape}, gold {gold.shape}")
    if mine.size == 0:
        return 0.0
    same_inf = np.isinf(mine) & (mine == gold)
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(mine - gold))
    return float(np.nan_to_num(diff, nan=np.inf).max())


@dataclass(frozen=True)
class Outcome:
    """Both results as float64 NumPy arrays, and the tolerance on their max abs difference.

    unseen: None, or a bool array that broadcasts to mine's shape, True on the rows that see no key.
    There ours must equal unseen_value exactly (0 for an output, -inf for a logsumexp) and torch's
    value is only recorded (torch_unseen): its kernels do not agree on what such a row holds.
    exact: None, or the same formula in extended precision (np.longdouble, rounded to float64 at the end),
    a third witness that says which side is off when the two differ (torch_off)."""

    mine: np.ndarray
    gold: np.ndarray
    tolerance: float
    unseen: np.ndarray | None = None
    unseen_value: float = 0.0
    exact: np.ndarray | None = None

    def _seen(self) -> np.ndarray:
        """True where both results are defined and compared."""
        if self.unseen is None:
            return np.ones(self.mine.shape, bool)
        return ~np.broadcast_to(self.unseen, self.mine.shape)

    @property
    def error(self) -> float:
        """max |mine - gold| over the rows that see a key."""
        seen = self._seen()
        return max_abs_error(self.mine[seen], self.gold[seen])

    @property
    def mine_unseen_exact(self) -> bool:
        """Ours is exactly unseen_value on every row that sees no key (True when there is none)."""
        return bool(np.all(self.mine[~self._seen()] == self.unseen_value))

    @property
    def torch_unseen(self) -> str:
        """What torch returned on the rows that see no key: "-" (no such row), "NaN", or its value of
        largest magnitude there ("0", "-1.91", "-inf" for a logsumexp)."""
        there = self.gold[~self._seen()]
        if there.size == 0:
            return "-"
        if np.isnan(there).any():
            return "NaN"
        return f"{float(there[np.argmax(np.abs(there))]):.3g}"

    @property
    def torch_off(self) -> bool:
        """Torch's value is off the exact one by more than the tolerance and ours is within it: the
        difference is torch's. (False without an exact witness.)"""
        if self.exact is None:
            return False
        seen = self._seen()
        exact = self.exact[seen]
        return (
            max_abs_error(self.gold[seen], exact) > self.tolerance
            and max_abs_error(self.mine[seen], exact) <= self.tolerance
        )

    @property
    def passed(self) -> bool:
        return (self.error <= self.tolerance or self.torch_off) and self.mine_unseen_exact

    def explain(self) -> str:
        """Where the two differ most, with both values (on failure, print both)."""
        if not self.mine_unseen_exact:
            there = self.mine[~self._seen()]
            return f"ours is not exactly {self.unseen_value} on the rows that see no key: {there[:8]!r}"
        diff = np.where(self._seen(), np.nan_to_num(np.abs(self.mine - self.gold), nan=np.inf), 0.0)
        where = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
        exact = "" if self.exact is None else f", exact {self.exact[where]!r}"
        return (
            f"max abs error {self.error:.3g} > tolerance {self.tolerance:.3g} at index {tuple(map(int, where))}: "
            f"mine {self.mine[where]!r}, gold {self.gold[where]!r}{exact}; shape {self.mine.shape}"
        )


@dataclass(frozen=True)
class Case:
    """name: what is compared; run(device, dtype) -> Outcome; dtypes: the dtypes it runs in;
    sdpa: whether torch's side goes through F.scaled_dot_product_attention, so that the case runs once
    per SDPA kernel (KERNELS) instead of once with torch's own choice."""

    name: str
    run: Callable[[str, str], Outcome]
    dtypes: tuple[str, ...]
    sdpa: bool = True


def kernels_for(case: Case, device: str) -> tuple[str | None, ...]:
    """The kernels a case runs with on a device: each SDPA kernel, or (None,) when torch's side does
    not call SDPA (RoPE, logsumexp)."""
    return KERNELS[device] if case.sdpa else (None,)


def run_case(case: Case, device: str, dtype: str, kernel: str | None) -> Outcome | None:
    """case.run with every SDPA call forced to `kernel` (None: torch's own choice); None where torch
    has no such kernel for these inputs."""
    if kernel is None:
        return case.run(device, dtype)
    try:
        with sdpa_kernel(BACKENDS[kernel]):
            return case.run(device, dtype)
    except RuntimeError as exc:
        if str(exc).startswith(NO_KERNEL):
            return None
        raise


# ---------------------------------------------------------------------------------------------------
# inputs and outputs


def make_inputs(
    name: str, shapes: Sequence[tuple[int, ...]], dtype: str, device: str, std: Sequence[float] | None = None
) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Random normal arrays, one per shape (std[i] times N(0, 1)), seeded by the case's name:
    (ours, theirs) where theirs are torch tensors in dtype on device and ours hold the same values."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    std = [1.0] * len(shapes) if std is None else std
    ours, theirs = [], []
    for shape, s in zip(shapes, std, strict=True):
        t = torch.from_numpy(s * rng.standard_normal(shape)).to(device=device, dtype=TORCH_DTYPES[dtype])
        ours.append(t.to("cpu", torch.float64).numpy().astype(NUMPY_DTYPES[dtype]))
        theirs.append(t)
    return ours, theirs


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def outcome(
    mine: np.ndarray,
    gold: torch.Tensor | np.ndarray,
    dtype: str,
    magnitude: float,
    unseen: np.ndarray | None = None,
    unseen_value: float = 0.0,
    exact: np.ndarray | None = None,
) -> Outcome:
    gold = to_numpy(gold) if isinstance(gold, torch.Tensor) else np.asarray(gold, np.float64)
    return Outcome(np.asarray(mine, np.float64), gold, tolerance(dtype, magnitude), unseen, unseen_value, exact)


def rows_with_no_key(allowed: np.ndarray) -> np.ndarray:
    """(..., L, 1): True for a query row whose bool mask (..., L, S) lets it see no key, kept as a
    trailing axis of 1 so that it broadcasts over an output (..., L, Ev)."""
    return ~allowed.any(axis=-1, keepdims=True)


def magnitude(v: np.ndarray) -> float:
    """max |v|: an attention output is a convex combination of rows of v, so it bounds |out|."""
    return float(np.abs(v).max())


# ---------------------------------------------------------------------------------------------------
# one_head: one causal head, T = 16 tokens, d_model 32, d_head 8


def one_head_case(device: str, dtype: str) -> Outcome:
    T, d_model, d_head = 16, 32, 8
    w = 1 / math.sqrt(d_model)  # nn.Linear's scale, so that q, k, v are about N(0, 1)
    (x, wq, wk, wv), (tx, twq, twk, twv) = make_inputs(
        "one_head",
        [(T, d_model), (d_model, d_head), (d_model, d_head), (d_model, d_head)],
        dtype,
        device,
        std=[1.0, w, w, w],
    )
    mine, _ = ta.one_head(x, wq, wk, wv)
    gold = F.scaled_dot_product_attention(tx @ twq, tx @ twk, tx @ twv, is_causal=True)
    return outcome(mine, gold, dtype, magnitude(x @ wv))  # |out| <= max |v|, v = x wv


# ---------------------------------------------------------------------------------------------------
# MultiHeadAttention against a torch module built from the same weights


def torch_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE the way Meta's Llama code writes it: pairs (0, 1), (2, 3), ... as complex numbers,
    multiplied by e^(i · position · θ), in complex64 as Llama does (complex128 for float64 input), and
    cast back to x's dtype. One change: the angles are computed in float64, as tinyattn_np does; Llama
    computes them in float32, which at position 1000 is off by ~1000 · 2^-24 = 6e-5 radians, the
    reference's own rounding and far above a float32 tolerance."""
    d = x.shape[-1]
    theta = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))  # (d/2,)
    angles = torch.outer(positions.to(torch.float64), theta)  # (T, d/2)
    real, complex_ = (torch.float64, torch.complex128) if x.dtype == torch.float64 else (torch.float32, torch.complex64)
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(complex_)  # (T, d/2): e^(i · angle)
    x_pairs = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], d // 2, 2).contiguous())  # (..., T, d/2)
    return torch.view_as_real(x_pairs * freqs_cis).flatten(-2).to(x.dtype)


def torch_rope_half_split(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE the way Hugging Face's Llama writes it: pairs (i, i + d/2), x · cos + rotate_half(x) · sin,
    with cos and sin cast to x's dtype, so in float16/bfloat16 the products and the sum round in the
    format. Angles in float64, as in torch_rope_interleaved."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).to(torch.float64) / d))
    freqs = torch.outer(positions.to(torch.float64), inv_freq)  # (T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return x * cos + rotate_half(x) * sin


class TorchMultiHeadAttention(torch.nn.Module):
    """The torch reference for tinyattn_np.MultiHeadAttention: one nn.Linear for q, k and v, its
    output columns split as [q heads | k heads | v heads], query head h reading kv head h // (H / Hkv)
    (repeat_interleave), SDPA, and an output nn.Linear. No bias, like ours."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_model // n_heads
        self.rope = rope
        self.qkv = torch.nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=False)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)

    @classmethod
    def from_numpy(cls, mha: ta.MultiHeadAttention, dtype: torch.dtype, device: str) -> TorchMultiHeadAttention:
        """Copy our weights in: nn.Linear.weight is (out, in), ours (in, out), so it takes the transpose."""
        module = cls(mha.d_model, mha.n_heads, mha.n_kv_heads, rope=mha.rope).to(device=device, dtype=dtype)
        with torch.no_grad():
            module.qkv.weight.copy_(torch.from_numpy(mha.w_qkv.T.copy()))
            module.out.weight.copy_(torch.from_numpy(mha.w_out.T.copy()))
        return module

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        B, T, C = x.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        q, k, v = self.qkv(x).split([H * dh, Hkv * dh, Hkv * dh], dim=-1)
        q = q.view(B, T, H, dh).transpose(1, 2)  # (B, H, T, dh)
        k = k.view(B, T, Hkv, dh).transpose(1, 2)  # (B, Hkv, T, dh)
        v = v.view(B, T, Hkv, dh).transpose(1, 2)
        if self.rope:
            positions = torch.arange(T, device=x.device)
            q, k = torch_rope_interleaved(q, positions), torch_rope_interleaved(k, positions)
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, T, dh): kv head g serves query heads gG .. gG+G-1
        v = v.repeat_interleave(H // Hkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, dh)
        return self.out(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def multihead_case(n_kv_heads: int, fused: bool, rope: bool = False) -> Callable[[str, str], Outcome]:
    def run(device: str, dtype: str) -> Outcome:
        B, T, d_model, n_heads = 2, 12, 48, 6
        mha = ta.MultiHeadAttention(
            d_model, n_heads, n_kv_heads, rope=rope, rng=np.random.default_rng(n_kv_heads), dtype=NUMPY_DTYPES[dtype]
        )
        (x,), (tx,) = make_inputs(f"mha {n_kv_heads} {fused} {rope}", [(B, T, d_model)], dtype, device)
        module = TorchMultiHeadAttention.from_numpy(mha, TORCH_DTYPES[dtype], device)
        mine = mha(x, causal=True, fused=fused)
        with torch.no_grad():
            gold = module(tx, causal=True)
        return outcome(mine, gold, dtype, magnitude(mine))  # no v bounds a whole module: its own size

    return run


# ---------------------------------------------------------------------------------------------------
# scaled_dot_product_attention, argument for argument


B, H, E = 2, 4, 16


def sdpa_case(
    L: int,
    S: int,
    *,
    mask: str | None = None,
    mask_shape: tuple[int, ...] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    hkv: int = H,
    fully_masked_rows: bool = False,
) -> Callable[[str, str], Outcome]:
    """mask: None, "bool" (True = may attend) or "float" (added to the scores), of mask_shape
    (default (B, H, L, S)); fully_masked_rows: rows 1 and L-1 of the mask hide every key."""

    def run(device: str, dtype: str) -> Outcome:
        name = f"sdpa {L} {S} {mask} {mask_shape} {is_causal} {scale} {hkv} {fully_masked_rows}"
        shape = mask_shape or (B, H, L, S)
        (q, k, v, noise), (tq, tk, tv, tnoise) = make_inputs(
            name, [(B, H, L, E), (B, hkv, S, E), (B, hkv, S, E), shape], dtype, device
        )
        attn_mask, t_mask, unseen = None, None, None
        if mask == "bool":
            allowed = noise > -0.5  # about 70 % of the keys visible
            allowed[..., 0] = True  # every row sees at least its first key...
            if fully_masked_rows:
                allowed[..., [1, L - 1], :] = False  # ...except these, which see none: output 0
            attn_mask, t_mask = allowed, torch.from_numpy(allowed).to(device)
            unseen = rows_with_no_key(allowed)
        elif mask == "float":
            attn_mask, t_mask = noise, tnoise  # added to the scores, in the query's dtype (torch asks for it)
            if fully_masked_rows:
                attn_mask = noise.copy()
                attn_mask[..., [1, L - 1], :] = -np.inf
                t_mask = tnoise.clone()
                t_mask[..., [1, L - 1], :] = float("-inf")
                unseen = rows_with_no_key(attn_mask > -np.inf)
        mine = ta.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=hkv != H
        )
        gold = F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=t_mask, is_causal=is_causal, scale=scale, enable_gqa=hkv != H
        )
        return outcome(mine, gold, dtype, magnitude(v), unseen)

    return run


# ---------------------------------------------------------------------------------------------------
# bottom-right causal: attention() and flash_attention() against torch's causal_lower_right(L, S)


def lower_right_gold(tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor) -> np.ndarray:
    """torch with causal_lower_right(L, S), as torch returns it. For L > S the first L - S queries see
    no key: torch warns that its kernels give NaN there; measured, its math and CPU kernels give 0 and
    its CUDA mem-efficient kernel non-zero values. Callers leave those rows out of the comparison
    (rows_with_no_key(causal_mask(L, S)))."""
    L, S = tq.shape[-2], tk.shape[-2]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Lower right causal bias will produce NaNs")
        return to_numpy(F.scaled_dot_product_attention(tq, tk, tv, attn_mask=causal_lower_right(L, S)))


def bottom_right_case(flash: bool, L: int, S: int, hkv: int = H, **flash_kw: int) -> Callable[[str, str], Outcome]:
    def run(device: str, dtype: str) -> Outcome:
        name = f"bottom_right {flash} {L} {S} {hkv} {flash_kw}"
        (q, k, v), (tq, tk, tv) = make_inputs(name, [(B, H, L, E), (B, hkv, S, E), (B, hkv, S, E)], dtype, device)
        if flash:
            mine = ta.flash_attention(q, k, v, causal=True, **flash_kw)
        else:
            mine = ta.attention(q, k, v, causal=True)
        # GQA spelled out with repeat_interleave (query head h reads kv head h // G), as enable_gqa does:
        # causal_lower_right hands q, k, v straight to torch's fused kernels on CUDA, so this case
        # stays about the mask alone
        group = H // hkv
        gold = lower_right_gold(tq, tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1))
        return outcome(mine, gold, dtype, magnitude(v), rows_with_no_key(ta.causal_mask(L, S)))

    return run


# ---------------------------------------------------------------------------------------------------
# flash_attention: long sequences, odd blocks, batch with GQA, and its logsumexp


def flash_case(
    batch: int, hq: int, hkv: int, L: int, S: int, e: int, causal: bool, **flash_kw: int
) -> Callable[[str, str], Outcome]:
    """causal=True with L == S (the only case where torch's is_causal and our bottom-right agree)."""

    def run(device: str, dtype: str) -> Outcome:
        name = f"flash {batch} {hq} {hkv} {L} {S} {e} {causal} {flash_kw}"
        shapes = [(batch, hq, L, e), (batch, hkv, S, e), (batch, hkv, S, e)]
        (q, k, v), (tq, tk, tv) = make_inputs(name, shapes, dtype, device)
        mine = ta.flash_attention(q, k, v, causal=causal, **flash_kw)
        gold = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=hkv != hq)
        return outcome(mine, gold, dtype, magnitude(v))

    return run


def flash_lse_case(L: int, S: int, **flash_kw: int) -> Callable[[str, str], Outcome]:
    """flash_attention's lse vs torch.logsumexp of the scaled, bottom-right-masked scores. For L > S the
    first L - S rows see no key: ours must be exactly -inf there (torch.logsumexp gives -inf too).
    The same lse in np.longdouble is the exact witness: torch's float64 value here has been seen off the
    exact one by 7e-10 in a test process (ours on it to the last bit), and it says which side is off."""

    def run(device: str, dtype: str) -> Outcome:
        (q, k, v), (tq, tk, _) = make_inputs(
            f"lse {L} {S} {flash_kw}", [(B, H, L, E), (B, H, S, E), (B, H, S, E)], dtype, device
        )
        _, lse = ta.flash_attention(q, k, v, causal=True, return_lse=True, **flash_kw)
        scores = tq @ tk.transpose(-1, -2) / math.sqrt(E)  # (B, H, L, S)
        allowed = ta.causal_mask(L, S)  # bottom-right, (L, S)
        gold = torch.logsumexp(scores.masked_fill(~torch.from_numpy(allowed).to(device), float("-inf")), dim=-1)
        finite = np.isfinite(lse)
        unseen = ~allowed.any(axis=-1)  # (L,): broadcasts over lse (B, H, L)
        exact = logsumexp_longdouble(q, k, allowed)  # (B, H, L)
        return outcome(lse, gold, dtype, float(np.abs(lse[finite]).max()), unseen, -np.inf, exact)

    return run


def logsumexp_longdouble(q: np.ndarray, k: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """log Σ_{allowed j} exp(q_i · k_j / √E) for q (..., L, E), k (..., S, E), allowed (L, S), computed in
    np.longdouble (NumPy's own loops, no BLAS; 64-bit mantissa on x86) and rounded to float64: (..., L)."""
    ql, kl = q.astype(np.longdouble), k.astype(np.longdouble)
    scores = np.einsum("...ie,...je->...ij", ql, kl) / np.sqrt(np.longdouble(q.shape[-1]))  # (..., L, S)
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)  # (..., L, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.where(np.isfinite(top), top, 0)
        return (np.log(np.exp(scores - top).sum(axis=-1)) + top[..., 0]).astype(np.float64)


# ---------------------------------------------------------------------------------------------------
# rope in both layouts


def rope_case(interleaved: bool, start: int = 0) -> Callable[[str, str], Outcome]:
    def run(device: str, dtype: str) -> Outcome:
        T, d = 32, 16
        (x,), (tx,) = make_inputs(f"rope {interleaved} {start}", [(2, 4, T, d)], dtype, device)
        positions = np.arange(start, start + T)
        mine = ta.rope(x, positions=positions, interleaved=interleaved)
        reference = torch_rope_interleaved if interleaved else torch_rope_half_split
        gold = reference(tx, torch.from_numpy(positions).to(device))
        return outcome(mine, gold, dtype, magnitude(x))  # a rotation: |out| <= √2 · max|x| per pair

    return run


# ---------------------------------------------------------------------------------------------------
# the list

CASES: list[Case] = [
    Case("one_head (causal) vs SDPA is_causal", one_head_case, FULL),
    *[
        Case(f"MultiHeadAttention H=6 Hkv={hkv} {'fused' if fused else 'unfused'}", multihead_case(hkv, fused), FULL)
        for hkv in (6, 2, 1)
        for fused in (True, False)
    ],
    Case("MultiHeadAttention H=6 Hkv=2 fused rope", multihead_case(2, True, rope=True), FULL),
    Case("sdpa bool mask", sdpa_case(7, 9, mask="bool"), ALL),
    Case("sdpa float mask", sdpa_case(7, 9, mask="float"), ALL),
    Case("sdpa is_causal L=S", sdpa_case(8, 8, is_causal=True), ALL),
    Case("sdpa is_causal L<S (top-left)", sdpa_case(5, 9, is_causal=True), ALL),
    Case("sdpa is_causal L>S (top-left)", sdpa_case(9, 5, is_causal=True), ALL),
    Case("sdpa scale=0.3", sdpa_case(7, 9, scale=0.3), ALL),
    Case("sdpa enable_gqa Hq=4 Hkv=2", sdpa_case(7, 9, hkv=2), ALL),
    Case("sdpa enable_gqa Hq=4 Hkv=1 is_causal", sdpa_case(9, 9, hkv=1, is_causal=True), ALL),
    Case("sdpa bool mask (L, S) broadcast", sdpa_case(7, 9, mask="bool", mask_shape=(7, 9)), ALL),
    Case("sdpa bool mask (B, 1, 1, S) padding", sdpa_case(7, 9, mask="bool", mask_shape=(B, 1, 1, 9)), ALL),
    Case("sdpa float mask (1, H, 1, S) broadcast", sdpa_case(7, 9, mask="float", mask_shape=(1, H, 1, 9)), ALL),
    Case("sdpa bool mask, fully masked rows", sdpa_case(7, 9, mask="bool", fully_masked_rows=True), ALL),
    Case("sdpa float mask, fully masked rows", sdpa_case(7, 9, mask="float", fully_masked_rows=True), ALL),
    Case("attention causal L<S (bottom-right)", bottom_right_case(False, 5, 12), ALL),
    Case("attention causal L>S (bottom-right)", bottom_right_case(False, 12, 5), ALL),
    Case("flash_attention causal L<S (bottom-right)", bottom_right_case(True, 37, 100, block_q=8, block_k=16), ALL),
    Case("flash_attention causal L>S (bottom-right)", bottom_right_case(True, 100, 37, block_q=16, block_k=8), ALL),
    Case("flash_attention causal L<S GQA Hkv=2", bottom_right_case(True, 20, 50, hkv=2, block_q=7, block_k=9), ALL),
    Case("flash_attention causal T=4096", flash_case(1, 2, 2, 4096, 4096, 64, True), ALL),
    Case(
        "flash_attention T=1000 blocks 37x53", flash_case(1, 1, 1, 1000, 1000, 32, False, block_q=37, block_k=53), ALL
    ),
    Case("flash_attention causal B=3 Hq=6 Hkv=2", flash_case(3, 6, 2, 129, 129, 16, True, block_q=31, block_k=17), ALL),
    Case("flash_attention lse L<S", flash_lse_case(40, 90, block_q=16, block_k=32), FULL, sdpa=False),
    Case(
        "flash_attention lse L>S (rows with no key)", flash_lse_case(90, 40, block_q=16, block_k=32), FULL, sdpa=False
    ),
    Case("rope interleaved (Llama complex multiply)", rope_case(True), ALL, sdpa=False),
    Case("rope half-split (HF rotate_half)", rope_case(False), ALL, sdpa=False),
    Case("rope interleaved, positions 1000..1031", rope_case(True, start=1000), ALL, sdpa=False),
]
