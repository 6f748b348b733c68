"""flex attention against torch: the same mods through torch.nn.attention.flex_attention on CPU (eager, and
compiled with torch.compile where the machine has a C++ compiler) and through SDPA with the dense mask or
bias; gradients against torch autograd through a plain torch implementation of each mod (torch's
flex_attention has no backward on CPU: "FlexAttention does not support backward on CPU").

Each mod is written twice, independently: ours from tinyattn_np.mods, and torch's here in torch ops. One
pair (SHARED_MASK, SHARED_SCORE) is written once and runs unchanged on both sides: plain Python functions
of the index arrays, using only what NumPy arrays and torch tensors share (comparisons, &, |, arithmetic,
abs).
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import make_inputs, to_numpy, tolerance  # noqa: E402
from torch.nn.attention import flex_attention as torch_flex  # noqa: E402

import tinyattn_np as ta  # noqa: E402

B, HQ, HKV, L, S, E = 2, 4, 2, 40, 56, 16
OFFSET = S - L  # bottom-right alignment
SLOPES = ta.alibi_slopes(HQ)
TABLE = np.random.default_rng(7).standard_normal((HQ, 9))  # relative bias, distances clipped to ±4
SINKS = np.array([0.5, -1.0, 1.5, 0.0])
IDS_Q, IDS_K = np.repeat([0, 1, 2], [10, 20, 10]), np.repeat([0, 1, 2], [12, 30, 14])
# the same in torch, for torch's mods: document ids, where each sequence ends, the prefix lengths
IDS_Q_T, IDS_K_T, ENDS_Q_T, ENDS_K_T = (
    torch.from_numpy(x) for x in (IDS_Q, IDS_K, np.array([10, 30, 40]), np.array([12, 42, 56]))
)
PREFIX_T = torch.tensor([5, 30])


def SHARED_MASK(b, h, q_idx, kv_idx):  # noqa: N802  (a constant of this module, named as one)
    """StreamingLLM's pattern, written once: the first key (the "sink token") and a window of 8."""
    return (kv_idx == 0) | ((kv_idx <= q_idx + OFFSET) & (q_idx + OFFSET - kv_idx < 8))


def SHARED_SCORE(score, b, h, q_idx, kv_idx):  # noqa: N802
    """An ALiBi-like bias, written once: slope 0.1 (h + 1) per head, bottom-right distance."""
    return score - 0.1 * (h + 1) * abs(q_idx + OFFSET - kv_idx)


# (name, our mask_mod, torch's mask_mod, B, H of the block mask)
MASKS = [
    ("causal", ta.causal_mod(L, S), lambda b, h, q, kv: kv <= q + OFFSET, None, None),
    ("causal top-left", ta.causal_mod(L, S, align="top_left"), lambda b, h, q, kv: kv <= q, None, None),
    ("window 6", ta.sliding_window_mod(6, L, S), lambda b, h, q, kv: (kv <= q + OFFSET) & (kv > q + OFFSET - 6),
     None, None),
    ("prefix-LM", ta.prefix_lm_mod(np.array([5, 30])), lambda b, h, q, kv: (kv < PREFIX_T[b]) | (kv <= q), B, None),
    ("causal documents", ta.and_masks(ta.document_mod(IDS_Q, IDS_K), ta.causal_mod(L, S)),
     lambda b, h, q, kv: (IDS_Q_T[q] == IDS_K_T[kv]) & (kv <= q + OFFSET), None, None),
    ("varlen causal", ta.varlen_mod([0, 10, 30, 40], [0, 12, 42, 56], causal=True),
     lambda b, h, q, kv: (IDS_Q_T[q] == IDS_K_T[kv]) & (kv - ENDS_K_T[IDS_Q_T[q]] <= q - ENDS_Q_T[IDS_Q_T[q]]),
     None, None),
    ("per head", lambda b, h, q, kv: (kv + h) % 3 != 0, lambda b, h, q, kv: (kv + h) % 3 != 0, None, HQ),
    ("shared", SHARED_MASK, SHARED_MASK, None, None),
]  # fmt: skip
# (name, our score_mod, torch's score_mod as a function of the torch parameters it reads)
SCORES = [
    ("none", None, lambda p: None),
    ("alibi", ta.Alibi(SLOPES, L, S, learned=True),
     lambda p: lambda s, b, h, q, kv: s - p["slopes"][h] * (q + OFFSET - kv).abs()),
    ("softcap 1.5", ta.Softcap(1.5), lambda p: lambda s, b, h, q, kv: 1.5 * torch.tanh(s / 1.5)),
    ("relative bias", ta.RelativeBias(TABLE, L, S),
     lambda p: lambda s, b, h, q, kv: s + p["table"][h, (kv - q - OFFSET).clamp(-4, 4) + 4]),
    ("shared", SHARED_SCORE, lambda p: SHARED_SCORE),
]  # fmt: skip


@contextmanager
def constants_in(dtype: torch.dtype):
    """torch makes `0.1 * int_tensor` in its default dtype, float32: in a float64 comparison the mods'
    constants must be float64 on torch's side too, as NumPy makes them."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype == torch.float64 else before)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def torch_inputs(name: str, dtype: str = "float64"):
    shapes = [(B, HQ, L, E), (B, HKV, S, E), (B, HKV, S, 8), (B, HQ, L, 8)]
    return make_inputs(f"flex {name}", shapes, dtype, "cpu")


def params(requires_grad: bool = False, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The mods' parameters as torch tensors, in the inputs' dtype: torch 2.13's compiled CPU kernel returns
    wrong numbers (NaN among them) when a score_mod reads a float64 tensor into float32 scores."""
    made = {"slopes": SLOPES, "table": TABLE, "sinks": SINKS}
    return {name: torch.from_numpy(x.copy()).to(dtype).requires_grad_(requires_grad) for name, x in made.items()}


def torch_flex_run(tq, tk, tv, score_mod, mask_mod, b_size, h_size, compiled: bool):
    """torch's flex_attention -> out, lse, as NumPy float64; compiled, out alone (lse is None): torch 2.13's
    compiled CPU kernel refuses return_lse ("`return_lse` is not supported yet")."""
    block_mask = torch_flex.create_block_mask(mask_mod, b_size, h_size, L, S, device="cpu", BLOCK_SIZE=16)
    run = torch.compile(torch_flex.flex_attention) if compiled else torch_flex.flex_attention
    with warnings.catch_warnings(), constants_in(tq.dtype):
        warnings.simplefilter("ignore")  # eager: "called without torch.compile()"; return_lse: deprecated name
        if compiled:
            return to_numpy(run(tq, tk, tv, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)), None
        out, lse = run(tq, tk, tv, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True)
    return to_numpy(out), to_numpy(lse)


def ours(q, k, v, score_mod, mask_mod, b_size, h_size, sinks=None):
    block_mask = ta.create_block_mask(mask_mod, b_size, h_size, L, S, BLOCK_SIZE=(7, 11))  # other tiles than torch's
    return ta.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True, sinks=sinks)


def check(mine, gold, dtype, magnitude, what):
    """Rows that see no key: ours 0 and -inf, torch's the same (flex on CPU); the rest within tolerance."""
    np.testing.assert_allclose(mine, gold, rtol=0, atol=tolerance(dtype, magnitude), err_msg=what)


@pytest.mark.parametrize("mask_index", range(len(MASKS)), ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("score_index", range(len(SCORES)), ids=[s[0] for s in SCORES])
def test_flex_equals_torch_flex_eager(mask_index, score_index):
    name, our_mask, torch_mask, b_size, h_size = MASKS[mask_index]
    score_name, our_score, torch_score = SCORES[score_index]
    (q, k, v, _), (tq, tk, tv, _) = torch_inputs(f"{name} {score_name}")
    out, lse = ours(q, k, v, our_score, our_mask, b_size, h_size)
    gold_out, gold_lse = torch_flex_run(tq, tk, tv, torch_score(params()), torch_mask, b_size, h_size, False)
    check(out, gold_out, "float64", float(np.abs(v).max()), f"out: {name} x {score_name}")
    check(lse, gold_lse, "float64", float(np.abs(lse[np.isfinite(lse)]).max()), f"lse: {name} x {score_name}")


BIASES = [i for i, (name, *_) in enumerate(SCORES) if name != "softcap 1.5"]  # softcap is no bias: no SDPA form


@pytest.mark.parametrize("score_index", BIASES, ids=[SCORES[i][0] for i in BIASES])
@pytest.mark.parametrize("mask_index", [0, 2, 4, 6], ids=[MASKS[i][0] for i in (0, 2, 4, 6)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_flex_equals_sdpa_with_the_dense_mask_and_bias(mask_index, score_index, dtype):
    """SDPA with attn_mask = the dense bool mask (torch's create_mask of torch's mask_mod) where there is no
    score_mod, else the float bias, -inf where hidden: a bias mod is score + bias; softcap is not one."""
    name, our_mask, torch_mask, b_size, h_size = MASKS[mask_index]
    score_name, our_score, torch_score = SCORES[score_index]
    (q, k, v, _), (tq, tk, tv, _) = torch_inputs(f"sdpa {name} {score_name}", dtype)
    allowed = torch_flex.create_mask(torch_mask, b_size or 1, h_size or 1, L, S, device="cpu")
    attn_mask = allowed
    if score_name != "none":  # the bias: torch's score_mod applied to zero scores, on broadcast index tensors
        b, h = torch.arange(B)[:, None, None, None], torch.arange(HQ)[None, :, None, None]
        with constants_in(tq.dtype):
            bias = torch_score(params())(
                torch.zeros(B, HQ, L, S, dtype=tq.dtype), b, h, torch.arange(L)[:, None], torch.arange(S)
            ).to(tq.dtype)
        attn_mask = bias.masked_fill(~allowed, float("-inf"))
    gold = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask, enable_gqa=True)
    out, _ = ours(q, k, v, our_score, our_mask, b_size, h_size)
    unseen = ~to_numpy(allowed).astype(bool).any(axis=-1)  # torch's SDPA gives NaN on a row that sees nothing
    gold_np = np.where(np.broadcast_to(unseen[..., None], out.shape), 0.0, to_numpy(gold))
    check(out, gold_np, dtype, float(np.abs(v).max()), f"{name} x {score_name} {dtype}")


def test_one_function_runs_unchanged_in_torch_and_here():
    """SHARED_MASK and SHARED_SCORE, the very same Python functions, through both flex_attentions."""
    (q, k, v, _), (tq, tk, tv, _) = torch_inputs("shared")
    out, lse = ours(q, k, v, SHARED_SCORE, SHARED_MASK, None, None)
    gold_out, gold_lse = torch_flex_run(tq, tk, tv, SHARED_SCORE, SHARED_MASK, None, None, False)
    check(out, gold_out, "float64", float(np.abs(v).max()), "shared mods")
    check(lse, gold_lse, "float64", float(np.abs(lse).max()), "shared mods, lse")


def compiled_or_skip(tq, tk, tv, score_mod, mask_mod, b_size, h_size):
    try:
        return torch_flex_run(tq, tk, tv, score_mod, mask_mod, b_size, h_size, True)
    except Exception as err:  # no C++ compiler, or inductor cannot build here: say so, never pass silently
        pytest.skip(f"torch.compile(flex_attention) does not run on this machine: {type(err).__name__}: {err}")


@pytest.mark.parametrize("case", ["shared", "causal documents x alibi"])
def test_flex_equals_torch_flex_compiled(case):
    """torch's compiled flex_attention (its fused CPU kernel), float32: two mods, each one compile (seconds)."""
    mask_index, score_index = (7, 4) if case == "shared" else (4, 1)
    name, our_mask, torch_mask, b_size, h_size = MASKS[mask_index]
    _, our_score, torch_score = SCORES[score_index]
    (q, k, v, _), (tq, tk, tv, _) = torch_inputs(f"compiled {case}", "float32")
    gold_out, _ = compiled_or_skip(tq, tk, tv, torch_score(params(dtype=tq.dtype)), torch_mask, b_size, h_size)
    out, _ = ours(q, k, v, our_score, our_mask, b_size, h_size)
    check(out, gold_out, "float32", float(np.abs(v).max()), f"compiled {case}")


# --- gradients: torch autograd through a plain torch implementation of each mod ----------------------


def torch_attention(tq, tk, tv, torch_score, torch_mask, b_size, h_size, p, sinks: bool):
    """softmax(where(mask, score_mod(q kᵀ / √E), -inf) [, sink]) v, written plainly in torch (autograd)."""
    k_all, v_all = (x.repeat_interleave(HQ // HKV, dim=1) for x in (tk, tv))
    scores = tq @ k_all.transpose(-1, -2) / E**0.5  # (B, HQ, L, S)
    b, h = torch.arange(B)[:, None, None, None], torch.arange(HQ)[None, :, None, None]
    q_idx, kv_idx = torch.arange(L)[:, None], torch.arange(S)[None, :]
    if torch_score is not None:
        scores = torch_score(scores, b, h, q_idx, kv_idx)
    allowed = torch.broadcast_to(torch_mask(b, h, q_idx, kv_idx), scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks:  # gpt-oss: the sink as a last column, softmax, then dropped
        scores = torch.cat([scores, p["sinks"].reshape(1, HQ, 1, 1).expand(B, HQ, L, 1)], dim=-1)
    # softmax with a row that sees nothing giving 0 (as ours), and no NaN in its gradient either
    shift = scores.amax(dim=-1, keepdim=True).clamp_min(-1e300).detach()  # softmax does not depend on it
    exp = torch.exp(scores - shift)
    weights = exp / exp.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    return weights[..., :S] @ v_all


@pytest.mark.parametrize("mask_index", [0, 1, 2, 3, 4, 6], ids=[MASKS[i][0] for i in (0, 1, 2, 3, 4, 6)])
@pytest.mark.parametrize("score_index", range(len(SCORES)), ids=[s[0] for s in SCORES])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_flex_backward_equals_torch_autograd(mask_index, score_index, sinks):
    name, our_mask, torch_mask, b_size, h_size = MASKS[mask_index]
    score_name, our_score, torch_score = SCORES[score_index]
    if our_score is SHARED_SCORE:  # the shared function is a bias: its derivative is 1, said for our backward
        our_score = ta.Differentiable(SHARED_SCORE, lambda score, b, h, q_idx, kv_idx: 1.0)
    (q, k, v, dout), (tq, tk, tv, tdout) = torch_inputs(f"grad {name} {score_name} {sinks}")
    p = params(requires_grad=True)
    leaves = [x.requires_grad_(True) for x in (tq, tk, tv)]
    with constants_in(torch.float64):
        out = torch_attention(*leaves, torch_score(p), torch_mask, b_size, h_size, p, sinks)
    out.backward(tdout)
    our_sinks = SINKS if sinks else None
    block_mask = ta.create_block_mask(our_mask, b_size, h_size, L, S, BLOCK_SIZE=(7, 11))
    mine_out, lse = ta.flex_attention(q, k, v, our_score, block_mask, enable_gqa=True, return_lse=True, sinks=our_sinks)
    grads = ta.flex_attention_backward(
        q, k, v, mine_out, dout, lse, score_mod=our_score, block_mask=block_mask, enable_gqa=True, sinks=our_sinks
    )
    size = float(max(np.abs(x).max() for x in (q, k, v, dout)))
    pairs = [("dq", grads.dq, leaves[0].grad), ("dk", grads.dk, leaves[1].grad), ("dv", grads.dv, leaves[2].grad)]
    if score_name == "alibi":
        pairs.append(("dslopes", grads.dscore_mod, p["slopes"].grad))
    if score_name == "relative bias":
        pairs.append(("dtable", grads.dscore_mod, p["table"].grad))
    if sinks:
        pairs.append(("dsinks", grads.dsinks, p["sinks"].grad))
    for what, mine, gold in pairs:  # sums over up to B·L·S terms of size ~size²: 64 ulps of size² · √(B·L·S)
        atol = tolerance("float64", size**2 * np.sqrt(B * L * S))
        np.testing.assert_allclose(mine, to_numpy(gold), rtol=0, atol=atol, err_msg=f"{what}: {name} x {score_name}")


def per_entry(b, h, q_idx, kv_idx):
    """A mask that differs between batch entries and heads, in operations NumPy and torch share."""
    return (kv_idx <= q_idx + b) & ((kv_idx + h) % 3 != 0)


def test_a_block_mask_indexed_by_batch_entry_and_head_has_torchs_tables():
    """block_mask[b], [:, h], [b, h] and slices: the same tiles as torch's BlockMask indexed the same way (an
    int keeps its axis in both); lengths a multiple of the tile, where torch pads nothing."""
    mine = ta.create_block_mask(per_entry, B, HQ, 32, 48, BLOCK_SIZE=16)
    theirs = torch_flex.create_block_mask(per_entry, B, HQ, 32, 48, device="cpu", BLOCK_SIZE=16)
    for index in [1, (slice(None), 2), (1, 2), (slice(0, 2), slice(1, 3))]:
        picked, gold = mine[index], theirs[index]
        np.testing.assert_array_equal(picked.to_dense(), gold.to_dense().numpy(), err_msg=str(index))
        np.testing.assert_array_equal(picked.kv_num_blocks, gold.kv_num_blocks.numpy(), err_msg=str(index))
        np.testing.assert_array_equal(picked.full_kv_num_blocks, gold.full_kv_num_blocks.numpy(), err_msg=str(index))


def test_key_and_value_of_batch_one_equal_torchs():
    """k, v with batch 1 against q with batch B, as torch's flex_attention allows (with a block mask of B)."""
    (q, k, v, _), (tq, tk, tv, _) = torch_inputs("kv batch 1")
    causal = MASKS[0][2]
    block_mask = torch_flex.create_block_mask(causal, B, None, L, S, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager: "called without torch.compile()"
        gold_out, gold_lse = torch_flex.flex_attention(
            tq, tk[:1], tv[:1], block_mask=block_mask, enable_gqa=True, return_lse=True
        )
    out, lse = ours(q, k[:1], v[:1], None, MASKS[0][1], None, None)
    check(out, to_numpy(gold_out), "float64", float(np.abs(v).max()), "out, k and v of batch 1")
    check(lse, to_numpy(gold_lse), "float64", float(np.abs(lse).max()), "lse, k and v of batch 1")


def test_a_torch_tensor_numpy_cannot_read_is_refused_with_what_to_pass():
    half = torch.ones(1, 4, 8, dtype=torch.bfloat16)
    recipe = re.escape("q.detach().float().cpu().numpy()")  # float32 holds every bfloat16 value
    with pytest.raises(TypeError, match="q is a Tensor of dtype torch.bfloat16 .*" + recipe):
        ta.flex_attention(half, half, half)
    learned = torch.ones(1, 4, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"requires grad.*q.detach\(\).cpu\(\).numpy\(\)"):
        ta.flash_attention(learned, learned, learned)
