"""The gated delta rule (linear.py): the plain recurrent loop against an oracle written token by token from the
rule's three lines, recurrent = chunked for every chunk size (the plain chunks and the engine's), the per-channel
decay (Kimi), the gradients against central differences and the chunked backward against the recurrent one; bad
input refused with the argument named; scripts/linear.py's smallest run. The layer built on it:
tests/test_deltanet.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_backward import numerical_grad  # central differences, one entry at a time

import tinyattn_np._guard as guard_module
import tinyattn_np._linear_kernel as kernel
from tinyattn_np import (
    AttentionMemoryError,
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_recurrent_backward,
)
from tinyattn_np import linear as linear_module

CHUNK_SIZES = [1, 2, 3, 5, 8, 13, 16, 64]  # T = 13: most leave a shorter last chunk


def make_inputs(rng, *, B=2, H=2, Hv=4, T=13, d_k=4, d_v=3, per_channel=False, dtype=np.float64):
    """q, k (B, H, T, d_k), v (B, Hv, T, d_v), g (B, Hv, T) or (B, Hv, T, d_k) in [-1, 0), beta (B, Hv, T) in
    (0, 1), a state (B, Hv, d_k, d_v)."""
    q, k = (rng.standard_normal((B, H, T, d_k)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, Hv, T, d_v)).astype(dtype)
    g = -rng.uniform(0.01, 1, (B, Hv, T, d_k) if per_channel else (B, Hv, T)).astype(dtype)
    beta = rng.uniform(0.05, 1, (B, Hv, T)).astype(dtype)
    return q, k, v, g, beta, rng.standard_normal((B, Hv, d_k, d_v)).astype(dtype)


def prepared(q, k, value_heads, l2norm=False):
    """q and k as gated_delta_rule hands them to the rule: unit length (l2norm), q / √d_k, each head repeated for
    the value heads it serves. Written apart from the package's own _prepare."""
    if l2norm:
        q, k = (x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    groups = value_heads // q.shape[1]
    return np.repeat(q / np.sqrt(q.shape[-1]), groups, axis=1), np.repeat(k, groups, axis=1)


def oracle(q, k, v, g, beta, state):
    """The three lines for each batch entry, head and token, with np.outer and a diagonal matrix: (o, state)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    state = np.array(state, np.float64)
    o = np.zeros(v.shape)
    for b, h in np.ndindex(v.shape[:2]):
        S = state[b, h]
        for t in range(v.shape[2]):
            decay = np.exp(g[b, h, t]) * np.ones(k.shape[-1])  # one per head, or one per key channel
            S = np.diag(decay) @ S
            S = S + beta[b, h, t] * np.outer(k[b, h, t], v[b, h, t] - S.T @ k[b, h, t])
            o[b, h, t] = S.T @ q[b, h, t]
        state[b, h] = S
    return o, state


def relative(mine, gold):
    mine, gold = np.asarray(mine, np.float64), np.asarray(gold, np.float64)
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


# --- the rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
def test_the_recurrent_loop_is_the_three_lines(per_channel):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(0), H=4, per_channel=per_channel)
    o, final = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    gold_o, gold_state = oracle(q, k, v, g, beta, state)
    assert relative(o, gold_o) < 1e-13 and relative(final, gold_state) < 1e-13


def test_one_step_is_gradient_descent_on_the_regression_loss():
    """With no decay, S + β k (v − Sᵀk)ᵀ is S − β ∇_S ½‖Sᵀk − v‖², the gradient taken by central differences."""
    rng = np.random.default_rng(1)
    S, k, v, beta = rng.standard_normal((4, 3)), rng.standard_normal(4), rng.standard_normal(3), 0.3
    loss = lambda: 0.5 * np.sum((S.T @ k - v) ** 2)  # noqa: E731
    step = S - beta * numerical_grad(loss, S)
    _, after = gated_delta_rule_recurrent(k[None], k[None], v[None], np.zeros(1), np.array([beta]), S)
    np.testing.assert_allclose(after, step, atol=1e-8)


def test_orthonormal_keys_and_a_step_of_one_store_each_value_exactly():
    keys, values = np.eye(4)[:3], np.random.default_rng(2).standard_normal((3, 5))  # 3 orthonormal keys
    o, state = gated_delta_rule_recurrent(keys, keys, values, np.zeros(3), np.ones(3))
    np.testing.assert_allclose(keys @ state, values, atol=1e-15)  # Sᵀk_i = v_i: every key reads its own value
    np.testing.assert_allclose(o, values, atol=1e-15)


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunked_equals_recurrent_for_every_chunk_size(chunk_size, per_channel):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(3), per_channel=per_channel)
    q_heads, k_heads = prepared(q, k, v.shape[1], l2norm=True)
    gold_o, gold_state = gated_delta_rule_recurrent(q_heads, k_heads, v, g, beta, state)
    plain = gated_delta_rule_chunked(q_heads, k_heads, v, g, beta, state, chunk_size=chunk_size)
    for form in (None, chunk_size):  # the engine's token loop, and its chunks
        o, final = gated_delta_rule(
            q, k, v, g, beta, chunk_size=form, initial_state=state, return_state=True, l2norm_qk=True
        )
        assert relative(o, gold_o) < 1e-12 and relative(final, gold_state) < 1e-12, form
    assert relative(plain[0], gold_o) < 1e-12 and relative(plain[1], gold_state) < 1e-12


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
def test_float32_stays_in_float32_and_close_to_float64_over_many_chunks(per_channel):
    """300 tokens in chunks of 16 and 64: float32 keeps its dtype and agrees with float64 to float32's precision;
    a strong decay (g down to −8 per token, e^(−512) across a chunk) overflows nothing."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, state = make_inputs(rng, T=300, d_k=32, d_v=16, per_channel=per_channel)
    g = g * rng.choice([1.0, 8.0], g.shape)
    gold = gated_delta_rule(q, k, v, g, beta, initial_state=state, l2norm_qk=True, chunk_size=None)
    for chunk_size in (16, 64):
        o = gated_delta_rule(
            *(x.astype(np.float32) for x in (q, k, v, g, beta)),
            chunk_size=chunk_size,
            initial_state=state.astype(np.float32),
            l2norm_qk=True,
        )
        assert o.dtype == np.float32 and np.all(np.isfinite(o))
        assert relative(o, gold) < 2e-5


def test_float16_is_computed_in_float32_and_cast_back():
    q, k, v, g, beta, _ = make_inputs(np.random.default_rng(5))
    o = gated_delta_rule(*(x.astype(np.float16) for x in (q, k, v)), g, beta, l2norm_qk=True)
    gold = gated_delta_rule(*(x.astype(np.float16).astype(np.float32) for x in (q, k, v)), g, beta, l2norm_qk=True)
    assert o.dtype == np.float16
    np.testing.assert_array_equal(o, gold.astype(np.float16))


@pytest.mark.parametrize("T", [0, 1])
def test_no_token_and_one_token(T):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(6), T=T)
    for chunk_size in (None, 64):
        o, final = gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True)
        gold = oracle(*prepared(q, k, v.shape[1]), v, g, beta, state)
        assert o.shape == v.shape
        np.testing.assert_allclose(o, gold[0], atol=1e-14)
        np.testing.assert_allclose(final, gold[1], atol=1e-14)


def test_the_workers_never_change_the_bits(monkeypatch):
    """The heads split over 1, 2 or 3 worker threads: the same output, state and gradients, bit for bit."""
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(7), B=3, T=20)
    monkeypatch.setattr(kernel, "HEAD_TOKENS_PER_WORKER", 1)
    results = []
    for cores in (1, 2, 3):
        monkeypatch.setattr(kernel, "cpu_cores", lambda cores=cores: cores)
        o, final = gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=state, return_state=True)
        grads = gated_delta_rule_backward(q, k, v, g, beta, o, chunk_size=8, initial_state=state)
        results.append((o, final, *grads))
    for other in results[1:]:
        for mine, gold in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(mine, gold)


# --- the gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_every_gradient_by_central_differences(chunk_size, per_channel):
    """dq, dk, dv, dg, dbeta and the initial state's gradient, through the L2 normalisation, the scale and the
    grouped heads, from a gradient of the output and one of the final state."""
    rng = np.random.default_rng(8)
    inputs = list(make_inputs(rng, B=1, H=1, Hv=2, T=6, d_k=3, d_v=2, per_channel=per_channel))
    dout, dstate = rng.standard_normal(inputs[2].shape), rng.standard_normal(inputs[5].shape)

    def loss():
        q, k, v, g, beta, state = inputs
        o, final = gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True, l2norm_qk=True
        )
        return np.sum(o * dout) + np.sum(final * dstate)

    grads = gated_delta_rule_backward(
        *inputs[:5], dout, chunk_size=chunk_size, initial_state=inputs[5], dstate=dstate, l2norm_qk=True
    )
    for name, x, grad in zip(grads._fields, inputs, grads, strict=True):
        assert relative(grad, numerical_grad(loss, x)) < 1e-8, name


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_the_chunked_backward_equals_the_recurrent_one(chunk_size, per_channel):
    rng = np.random.default_rng(9)
    q, k, v, g, beta, state = make_inputs(rng, T=37, d_k=8, d_v=5, per_channel=per_channel)
    dout = rng.standard_normal(v.shape)
    gold = gated_delta_rule_backward(q, k, v, g, beta, dout, chunk_size=None, initial_state=state)
    grads = gated_delta_rule_backward(q, k, v, g, beta, dout, chunk_size=chunk_size, initial_state=state)
    for name, mine, ref in zip(grads._fields, grads, gold, strict=True):
        assert mine.shape == ref.shape and relative(mine, ref) < 1e-11, name


def test_the_plain_backward_is_the_reference_on_prepared_inputs():
    """gated_delta_rule_recurrent_backward takes what gated_delta_rule_recurrent takes; without an initial state
    its dinitial_state is None."""
    rng = np.random.default_rng(10)
    q, k, v, g, beta, _ = make_inputs(rng, H=4)
    dout = rng.standard_normal(v.shape)
    plain = gated_delta_rule_recurrent_backward(q, k, v, g, beta, dout)
    scaled = gated_delta_rule_backward(q * 2.0, k, v, g, beta, dout, chunk_size=5)  # d_k = 4: the scale is ½
    assert plain.dinitial_state is None and scaled.dinitial_state is None
    for name in ("dk", "dv", "dg", "dbeta"):
        assert relative(getattr(scaled, name), getattr(plain, name)) < 1e-12, name
    assert relative(scaled.dq * 2.0, plain.dq) < 1e-12


# --- bad input ----------------------------------------------------------------------------------------

Q, K, V, G, BETA, STATE = make_inputs(np.random.default_rng(16))
BAD_RULE = [  # (keyword arguments that replace good ones, the error, words its message must hold)
    (dict(g=-G), ValueError, "g is the log of a decay and must be <= 0"),
    (dict(g=np.where(G < -0.5, np.nan, G)), ValueError, "g must be finite"),
    (dict(beta=BETA * 3), ValueError, r"beta must lie in \[0, 2\]"),
    (dict(beta=-BETA), ValueError, "beta must lie"),
    (dict(q=Q[:, :, :5]), ValueError, "q must be"),
    (dict(k=K[..., :3]), ValueError, "k must have shape"),
    (dict(v=V[:, :3]), ValueError, "must be a multiple of"),
    (dict(g=G[..., None]), ValueError, "g must have shape"),
    (dict(beta=BETA[:, :, :5]), ValueError, "beta must have shape"),
    (dict(initial_state=STATE[..., :2]), ValueError, "initial_state must have shape"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(chunk_size=True), TypeError, "chunk_size must be a positive int"),
    (dict(return_state="yes"), TypeError, "return_state must be True or False"),
    (dict(l2norm_qk=1), TypeError, "l2norm_qk must be True or False"),
    (dict(q=Q.astype(np.int64)), TypeError, "q must be float16, float32 or float64"),
]


@pytest.mark.parametrize(("change", "error", "words"), BAD_RULE, ids=[str(list(c)) for c, _, _ in BAD_RULE])
def test_bad_input_to_the_rule_names_the_argument(change, error, words):
    given = dict(q=Q, k=K, v=V, g=G, beta=BETA, initial_state=STATE)
    given.update(change)
    q, k, v, g, beta = (given.pop(name) for name in ("q", "k", "v", "g", "beta"))
    with pytest.raises(error, match=words):
        gated_delta_rule(q, k, v, g, beta, **given)


def test_bad_input_to_the_backward_and_the_plain_loops_names_the_argument():
    with pytest.raises(ValueError, match="dout must have shape"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V[:, :, :3])
    with pytest.raises(ValueError, match="dstate must have shape"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V, dstate=STATE[:, :2])
    with pytest.raises(ValueError, match="q must be"):
        gated_delta_rule_recurrent(Q, K, V, G, BETA)  # the plain loops take q and k already repeated to Hv heads
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gated_delta_rule_chunked(*prepared(Q, K, 4), V, G, BETA, chunk_size=-1)


def test_the_memory_guard_refuses_before_the_chunks_run(monkeypatch):
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1000)
    with pytest.raises(AttentionMemoryError, match="gated_delta_rule would allocate"):
        gated_delta_rule(Q, K, V, G, BETA)
    with pytest.raises(AttentionMemoryError, match="gated_delta_rule_recurrent_backward would allocate"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V, chunk_size=None)


def test_the_lesson_opens_with_the_plain_loop():
    """linear.py's first definition is the recurrent loop, the rule as its three lines (the house's rule 1)."""
    import ast

    tree = ast.parse(open(linear_module.__file__, encoding="utf-8").read())
    first = next(node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef))
    assert first.name == "gated_delta_rule_recurrent"


# --- scripts/linear.py --------------------------------------------------------------------------------


def test_the_script_runs_small_and_prints_every_section(machine, tmp_path, capsys):
    """scripts/linear.py's smallest run: its four sections and checks, every line within a terminal's 120
    columns, the figures written as JSON (timings aside: the machine is quiet by fiat here, the fixture)."""
    import json

    from test_scripts import load, parts_so_far

    script = load("linear.py")
    flags = "--tokens 64 --heads 2 --head-dim 16 --chunk-sizes 16 32 --contexts 32 256 --repeats 1".split()
    flags += ["--json", str(tmp_path / "linear.json")]
    assert script.main(flags) == 0
    out = capsys.readouterr().out
    sections = ("1) the prefill", "2) the chunk size", "3) one decode step", "4) where the chunked prefill's time goes")
    for section in (*sections, "all checks passed"):
        assert section in out, out
    # 4) the parts in order, the time so far growing, the aim said from the same figures
    so_far = parts_so_far(out, ["matmuls", "the triangular inverse", "element-wise lines"])
    aim = re.search(r"with the triangular inverse ([\d.]+)x:\n   (above|within) the aim of 2x", out)
    assert aim and float(aim[1]) == so_far[1] and aim[2] == ("above" if so_far[1] > 2 else "within"), out
    assert "the copy gives its output and state: yes" in out
    assert max(len(line) for line in out.splitlines()) <= 120
    figures = json.loads((tmp_path / "linear.json").read_text())
    assert [row["context"] for row in figures["decode"]] == [32, 256] and len(figures["chunk_sizes"]) == 2
    assert [row["tokens"] for row in figures["parts"]] == [64] and figures["parts"][0]["same_bits"]
