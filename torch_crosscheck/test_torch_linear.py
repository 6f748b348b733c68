"""The gated delta rule against transformers' torch functions, and Qwen3-Next's Gated DeltaNet layer against
transformers' Qwen3NextGatedDeltaNet with the same weights: outputs and final states (with and without an initial
state, l2norm on and off, grouped value heads, T not a multiple of the chunk, T = 1), the per-channel decay against
Kimi Linear's functions, every gradient against torch autograd, the layer's forward, gradients and cached decoding,
and the bytes its cache holds beside transformers'.

transformers computes the rule in float32 whatever the inputs' dtype (torch_chunk_gated_delta_rule casts to
torch.float32), and its layer's gated RMSNorm and decay too. Two ways to compare, as test_torch_latent does:
AS_IS, transformers as it runs, to float32's precision; and IN_FLOAT64, its same source with each float32 cast
made a float64 one (in_float64 below: the function's text, torch.float32 -> torch.float64 and .float() ->
.double(), compiled in its own module's namespace), to float64's rounding.

Our weights are x @ W (W (in, out)), named after Qwen3.5's Qwen3_5GatedDeltaNet: w_qkv = in_proj_qkv.weightᵀ,
w_z, w_b, w_a likewise, conv = conv1d.weight[:, 0], norm = norm.weight, w_out = out_proj.weightᵀ. Qwen3-Next
fuses the first four into in_proj_qkvz and in_proj_ba, interleaved per key head (to_qwen3_next below).
"""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devices import DEVICE_PARAMS  # noqa: E402  (needs torch, so after the importorskip)
from transformers import Qwen3_5TextConfig, Qwen3NextConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as kimi  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next  # noqa: E402

from tinyattn_np import (  # noqa: E402
    GatedDeltaCache,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_deltanet,
    gated_deltanet_backward,
)

# relative to the largest entry: the rule's float32 over 37 tokens agrees to 2e-6, the layer's gradients (its
# norm and decay in float32 too) to 1e-5; in float64 both agree to 1e-12, the gradients to 1e-11
AS_IS, AS_IS_LAYER, IN_FLOAT64 = 2e-6, 1e-5, 1e-12
SHAPE = GatedDeltaNetShape(d_model=32, key_heads=2, value_heads=4, key_dim=8, value_dim=6, conv_kernel=4)


def in_float64(function, **replacing):
    """transformers' `function` with its float32 casts made float64: its source with torch.float32 ->
    torch.float64 and .float() -> .double(), decorators dropped, compiled in a copy of its module's namespace
    where `replacing` names other functions it calls."""
    lines = textwrap.dedent(inspect.getsource(function)).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("def "))
    source = "\n".join(lines[first:]).replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace = {**vars(inspect.getmodule(function)), **replacing}
    exec(compile(source, f"<{function.__qualname__} in float64>", "exec"), namespace)
    return namespace[function.__name__]


QWEN_RULE = {
    "chunked": qwen3_next.torch_chunk_gated_delta_rule,
    "recurrent": qwen3_next.torch_recurrent_gated_delta_rule,
}
KIMI_RULE = {"chunked": kimi.chunk_kimi_delta_attention, "recurrent": kimi.recurrent_kimi_delta_attention}


def relative(mine, gold):
    gold = gold.detach().cpu().numpy() if hasattr(gold, "detach") else np.asarray(gold)
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


def rule_inputs(rng, *, H, Hv, T, per_channel=False, d_k=8, d_v=6):
    q, k = (rng.standard_normal((2, H, T, d_k)) for _ in range(2))
    v = rng.standard_normal((2, Hv, T, d_v))
    g = -rng.uniform(0.01, 1, (2, Hv, T, d_k) if per_channel else (2, Hv, T))
    return q, k, v, g, rng.uniform(0.05, 1, (2, Hv, T)), rng.standard_normal((2, Hv, d_k, d_v))


def torch_layout(x, device, grad=False):
    """(B, H, T, ...) -> transformers' (B, T, H, ...), a float64 tensor on device."""
    tensor = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, 2, 1))).to(device)
    return tensor.requires_grad_(grad)


# --- the rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("precision", ["as is", "in float64"])
@pytest.mark.parametrize("heads", [(4, 4), (2, 4)], ids=["H = Hv", "grouped value heads"])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no l2norm"])
@pytest.mark.parametrize("with_state", [True, False], ids=["initial state", "zeros"])
def test_the_rule_equals_transformers(device, precision, heads, T, l2norm, with_state):
    """Ours, recurrent and in chunks of 16, against both of transformers' functions (its chunks of 16 too):
    T = 37 is three chunks, the last one shorter (transformers pads it), T = 1 one token."""
    q, k, v, g, beta, state = rule_inputs(np.random.default_rng(T), H=heads[0], Hv=heads[1], T=T)
    state = state if with_state else None
    tol = AS_IS if precision == "as is" else IN_FLOAT64
    for name, function in QWEN_RULE.items():
        function = function if precision == "as is" else in_float64(function)
        extra = {"chunk_size": 16} if name == "chunked" else {}
        gold, gold_state = function(
            *(torch_layout(x, device) for x in (q, k, v, g, beta)),
            **extra,
            initial_state=None if state is None else torch.from_numpy(state).to(device),
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )
        gold = gold.transpose(1, 2)
        for chunk_size in (None, 16):
            o, final = gated_delta_rule(
                q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True, l2norm_qk=l2norm
            )
            assert relative(o, gold) < tol and relative(final, gold_state) < tol, (name, chunk_size)


@pytest.mark.parametrize("precision", ["as is", "in float64"])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("with_state", [True, False], ids=["initial state", "zeros"])
def test_a_decay_per_key_channel_equals_kimi_linears(precision, T, with_state):
    """Kimi Delta Attention: g (B, H, T, d_k); Kimi's functions take no grouped heads, and always L2-normalise
    q and k inside the layer (use_qk_l2norm_in_kernel=True there)."""
    q, k, v, g, beta, state = rule_inputs(np.random.default_rng(T), H=4, Hv=4, T=T, per_channel=True)
    state = state if with_state else None
    tol = AS_IS if precision == "as is" else IN_FLOAT64
    for name, function in KIMI_RULE.items():
        function = function if precision == "as is" else in_float64(function)
        extra = {"chunk_size": 16} if name == "chunked" else {}
        gold, gold_state = function(
            *(torch_layout(x, "cpu") for x in (q, k, v, g, beta)),
            **extra,
            initial_state=None if state is None else torch.from_numpy(state),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        for chunk_size in (None, 16):
            o, final = gated_delta_rule(
                q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True, l2norm_qk=True
            )
            gold_o = gold.transpose(1, 2)
            assert relative(o, gold_o) < tol and relative(final, gold_state) < tol, (name, chunk_size)


@pytest.mark.parametrize("per_channel", [False, True], ids=["Qwen3-Next: a decay per head", "Kimi: per channel"])
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_every_gradient_equals_autograd(per_channel, chunk_size):
    """dq, dk, dv, dg, dbeta and the initial state's gradient against torch autograd of transformers' chunked
    function in float64, from a gradient of the output and one of the final state (T = 37: three chunks)."""
    H, Hv = (4, 4) if per_channel else (2, 4)
    rng = np.random.default_rng(5)
    inputs = rule_inputs(rng, H=H, Hv=Hv, T=37, per_channel=per_channel)
    dout, dstate = rng.standard_normal(inputs[2].shape), rng.standard_normal(inputs[5].shape)
    function = in_float64(KIMI_RULE["chunked"] if per_channel else QWEN_RULE["chunked"])
    tensors = [torch_layout(x, "cpu", grad=True) for x in inputs[:5]]
    state = torch.from_numpy(inputs[5]).requires_grad_(True)
    o, final = function(
        *tensors, chunk_size=16, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ((o * torch_layout(dout, "cpu")).sum() + (final * torch.from_numpy(dstate)).sum()).backward()
    grads = gated_delta_rule_backward(
        *inputs[:5], dout, chunk_size=chunk_size, initial_state=inputs[5], dstate=dstate, l2norm_qk=True
    )
    golds = [t.grad.transpose(1, 2) for t in tensors] + [state.grad]
    for name, mine, gold in zip(grads._fields, grads, golds, strict=True):
        assert relative(mine, gold) < IN_FLOAT64 * 10, name


# --- the layer ----------------------------------------------------------------------------------------


def config(kind=Qwen3NextConfig, shape=SHAPE):
    return kind(
        hidden_size=shape.d_model,
        linear_num_key_heads=shape.key_heads,
        linear_num_value_heads=shape.value_heads,
        linear_key_head_dim=shape.key_dim,
        linear_value_head_dim=shape.value_dim,
        linear_conv_kernel_dim=shape.conv_kernel,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=shape.eps,
    )


def make_weights(seed=0):
    """Random float64 weights, the norm's gain not 1 and the decays of a few tokens' reach."""
    rng = np.random.default_rng(seed)
    w = SHAPE.init_weights(rng=rng, dtype=np.float64)
    big = {name: 0.3 * rng.standard_normal(x.shape) for name, x in w._asdict().items() if x.ndim == 2}
    return w._replace(
        **big, norm=rng.uniform(0.5, 1.5, SHAPE.value_dim), a_log=np.log(rng.uniform(0.1, 1.0, SHAPE.value_heads))
    )


def to_qwen3_next(w, shape=SHAPE):
    """in_proj_qkvz and in_proj_ba's weights (out, in) from ours: per key head h, [q_h | k_h | v_h | z_h] and
    [b_h | a_h], where v_h, z_h, b_h, a_h are the Hv / Hk value heads that key head serves."""
    keys, groups = shape.key_heads * shape.key_dim, shape.value_heads // shape.key_heads
    q, k, v = np.split(w.w_qkv, [keys, 2 * keys], axis=1)
    per_head = lambda x: np.split(x, shape.key_heads, axis=1)  # noqa: E731  (C, ·) -> Hk pieces
    qkvz = [np.concatenate(parts, axis=1) for parts in zip(*map(per_head, (q, k, v, w.w_z)), strict=True)]
    ba = [np.concatenate(parts, axis=1) for parts in zip(*map(per_head, (w.w_b, w.w_a)), strict=True)]
    assert qkvz[0].shape[1] == 2 * shape.key_dim + 2 * groups * shape.value_dim
    return np.concatenate(qkvz, axis=1).T, np.concatenate(ba, axis=1).T


def from_qwen3_next(qkvz, ba, shape=SHAPE):
    """The inverse of to_qwen3_next for the first four weights (w_qkv, w_z, w_b, w_a), from (out, in) arrays."""
    Dk, G, Dv = shape.key_dim, shape.value_heads // shape.key_heads, shape.value_dim
    heads = np.split(qkvz.T, shape.key_heads, axis=1)  # each (C, 2 Dk + 2 G Dv)
    q, k, v, z = ([np.split(h, np.cumsum([Dk, Dk, G * Dv]), axis=1)[i] for h in heads] for i in range(4))
    b, a = ([np.split(h, [G], axis=1)[i] for h in np.split(ba.T, shape.key_heads, axis=1)] for i in range(2))
    return np.concatenate(q + k + v, axis=1), *(np.concatenate(x, axis=1) for x in (z, b, a))


def qwen3_next_layer(w, device, shape=SHAPE, dtype=torch.float64):
    """transformers' Qwen3NextGatedDeltaNet of this shape holding our weights w, in dtype on device."""
    theirs = qwen3_next.Qwen3NextGatedDeltaNet(config(shape=shape), 0).to(device=device, dtype=dtype)
    load_qwen3_next(theirs, w, shape)
    return theirs


def load_qwen3_next(theirs, w, shape=SHAPE):
    """Our weights w into transformers' layer `theirs`: the fused projections interleaved, the rest as they are."""
    qkvz, ba = to_qwen3_next(w, shape)
    with torch.no_grad():
        for module, value in ((theirs.in_proj_qkvz, qkvz), (theirs.in_proj_ba, ba), (theirs.out_proj, w.w_out.T)):
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(value)))
        theirs.conv1d.weight.copy_(torch.from_numpy(w.conv[:, None, :].copy()))
        for param, value in ((theirs.dt_bias, w.dt_bias), (theirs.A_log, w.a_log), (theirs.norm.weight, w.norm)):
            param.copy_(torch.from_numpy(np.asarray(value)))


def weights_of_qwen3_next(theirs, shape=SHAPE, grad=False):
    """Our GatedDeltaNetWeights from transformers' layer: its weights, or with grad=True their gradients."""
    value = lambda p: (p.grad if grad else p).detach().cpu().numpy()  # noqa: E731
    first_four = from_qwen3_next(value(theirs.in_proj_qkvz.weight), value(theirs.in_proj_ba.weight), shape)
    rest = (value(theirs.conv1d.weight)[:, 0], value(theirs.dt_bias), value(theirs.A_log), value(theirs.norm.weight))
    return GatedDeltaNetWeights(*first_four, *rest, value(theirs.out_proj.weight).T)


def qwen3_next_in_float64(monkeypatch):
    """Qwen3NextGatedDeltaNet's forward and its gated norm with their float32 casts made float64, the rule's two
    functions too: the same layer, every line in float64."""
    rules = {
        name: in_float64(getattr(qwen3_next, name))
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    }
    layer, norm = qwen3_next.Qwen3NextGatedDeltaNet, qwen3_next.Qwen3NextRMSNormGated
    monkeypatch.setattr(layer, "forward", in_float64(layer.forward, **rules))
    monkeypatch.setattr(norm, "forward", in_float64(norm.forward))


@pytest.fixture
def layer_in_float64(monkeypatch):
    qwen3_next_in_float64(monkeypatch)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("precision", ["as is", "in float64"])
def test_the_layer_and_its_gradients_equal_qwen3_nexts(request, device, precision):
    tol = AS_IS_LAYER
    if precision == "in float64":
        request.getfixturevalue("layer_in_float64")
        tol = IN_FLOAT64 * 10
    w = make_weights()
    theirs = qwen3_next_layer(w, device)
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 37, SHAPE.d_model)), rng.standard_normal((2, 37, SHAPE.d_model))
    x_t = torch.from_numpy(x).to(device).requires_grad_(True)
    gold = theirs(x_t)
    (gold * torch.from_numpy(dy).to(device)).sum().backward()
    y, saved = gated_deltanet(x, w, SHAPE)
    assert relative(y, gold) < tol
    dx, grads = gated_deltanet_backward(dy, saved)
    assert relative(dx, x_t.grad) < tol
    golds = weights_of_qwen3_next(theirs, grad=True)
    for name, mine, ref in zip(GatedDeltaNetWeights._fields, grads, golds, strict=True):
        assert relative(mine, ref) < tol, name


def test_the_weights_are_qwen3_5s_as_they_come():
    """Qwen3.5's layer holds the same weights apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): copied as
    they are, transposed, they give the same output."""
    w = make_weights(2)
    theirs = qwen3_5.Qwen3_5GatedDeltaNet(config(Qwen3_5TextConfig), 0).to(torch.float64)
    with torch.no_grad():
        for name in ("qkv", "z", "b", "a"):
            getattr(theirs, f"in_proj_{name}").weight.copy_(torch.from_numpy(getattr(w, f"w_{name}").T.copy()))
        theirs.out_proj.weight.copy_(torch.from_numpy(w.w_out.T.copy()))
        theirs.conv1d.weight.copy_(torch.from_numpy(w.conv[:, None, :].copy()))
        for param, value in ((theirs.dt_bias, w.dt_bias), (theirs.A_log, w.a_log), (theirs.norm.weight, w.norm)):
            param.copy_(torch.from_numpy(value))
    x = np.random.default_rng(3).standard_normal((2, 20, SHAPE.d_model))
    assert relative(gated_deltanet(x, w, SHAPE)[0], theirs(torch.from_numpy(x))) < AS_IS


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cached_decoding_equals_qwen3_nexts_and_holds_one_input_less(device, dtype):
    """A prompt of 6 tokens, two one-token steps, a chunk of two: each output equals transformers' through its
    DynamicCache. Both hold the rule's state (transformers' in float32 whatever the model's dtype) and the
    convolution's last inputs: ours the K − 1 the next step reads, transformers' K, the oldest never read again."""
    w = make_weights(4)
    theirs = qwen3_next_layer(w, device).to(torch.float64 if dtype == np.float64 else torch.float32)
    w = GatedDeltaNetWeights(*(x.astype(dtype) for x in w))
    x = np.random.default_rng(5).standard_normal((2, 10, SHAPE.d_model)).astype(dtype)
    ours, cache = GatedDeltaCache(2, SHAPE, dtype), DynamicCache(config=config())
    with torch.no_grad():
        for start, stop in [(0, 6), (6, 7), (7, 8), (8, 10)]:
            gold = theirs(torch.from_numpy(x[:, start:stop]).to(device), cache=cache)
            y, _ = gated_deltanet(x[:, start:stop], w, SHAPE, cache=ours)
            assert relative(y, gold) < (1e-4 if dtype == np.float32 else AS_IS), (start, stop)
    layer = cache.layers[0]
    conv, state = layer.conv_states[0].cpu().numpy(), layer.recurrent_states[0].cpu().numpy()  # (B, ch, K), (B, ...)
    assert conv.shape == (2, SHAPE.conv_channels, SHAPE.conv_kernel) and state.dtype == np.float32
    np.testing.assert_allclose(ours.conv_inputs, conv[:, :, 1:].transpose(0, 2, 1), rtol=1e-6, atol=1e-6)
    assert relative(ours.state, state) < 1e-5
    if dtype == np.float32:  # the same dtype on both sides: the bytes differ by the input transformers keeps more
        assert conv.nbytes + state.nbytes == ours.nbytes + 2 * SHAPE.conv_channels * 4
