"""The GPT of gpt.py trained for 10 AdamW steps beside a torch model of the same architecture, loaded with
the same initial weights and fed the same batches: the loss of every step and the weights after the last
must agree (float64: 1e-10 relative; float32: 1e-5).

The losses are compared step by step. The weights: in float64 element by element (within 1e-10 of the array's
largest weight); in float32 array by array, ‖ours - torch's‖ <= 1e-5 ‖torch's‖. Adam's step is about lr in size
whatever the gradient's size (m̂ / √v̂), so an element whose gradient is a float32 cancellation of larger terms
moves in the rounding's direction by up to lr in either model: such elements (a few per thousand) differ by more
than 1e-5 of the largest weight while the array as a whole agrees to a few parts in a million.

The torch side is built from torch's own layers: nn.Embedding (and a second, nanoGPT's wpe, for a learned
position table), nn.LayerNorm or nn.RMSNorm, the reference attention module of cases.py (nn.Linear for q, k, v
and out, Llama's interleaved RoPE unless there is a table, SDPA), nn.Linear and F.gelu(approximate="tanh") or
silu for the MLP, the embedding matrix reused as the head (tied), F.cross_entropy, torch.optim.AdamW with decay
on the matrices only, and torch.nn.utils.clip_grad_norm_. Our matrices multiply from the right (x @ W), so every
nn.Linear takes the transpose.

A hybrid GPT (layer_pattern) puts transformers' Qwen3NextGatedDeltaNet where ours has a gated delta layer, loaded
as test_torch_linear.py loads it (its fused projections interleaved per key head); in float64 its float32 casts
are made float64 (test_torch_linear.qwen3_next_in_float64), as transformers computes the rule in float32 else.
In float32 the two compute the rule by different algorithms (ours inverts each chunk's triangular system by
blocks, transformers substitutes row by row) and agree to about 1e-6 a forward; after 10 steps a hybrid's losses
still agree to 1e-5, its weights array by array to 3e-5 of their norm (1.5e-5 seen).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import TorchMultiHeadAttention  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402

from tinyattn_np import GatedDeltaNetWeights  # noqa: E402
from tinyattn_np.gpt import GPT, GPT_PRESETS, GPTConfig  # noqa: E402
from tinyattn_np.optim import AdamW, clip_grad_norm, warmup_cosine_lr  # noqa: E402

STEPS, LR, WARMUP, CLIP = 10, 3e-3, 3, 1.0
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
HYBRID_FLOAT32 = 3e-5  # a hybrid's weights in float32: the rule by two algorithms (the module docstring)


class TorchBlock(torch.nn.Module):
    def __init__(self, c: GPTConfig, layer: int):
        super().__init__()
        C, H = c.width, c.hidden
        self.ln_1, self.ln_2 = make_norm(c), make_norm(c)
        self.delta = c.layer_kind(layer) == "L"
        rope = c.positions == "rope"  # beside a learned table the attention turns nothing
        self.attn = qwen3_next_delta(c) if self.delta else TorchMultiHeadAttention(C, c.heads, c.heads, rope=rope)
        self.fc = torch.nn.Linear(C, 2 * H if c.mlp == "swiglu" else H, bias=c.bias)
        self.proj = torch.nn.Linear(H, C, bias=c.bias)
        self.kind = c.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + (self.attn(self.ln_1(x)) if self.delta else self.attn(self.ln_1(x), causal=True))
        a = self.fc(self.ln_2(x))
        if self.kind == "gelu":
            h = F.gelu(a, approximate="tanh")
        else:
            gate, up = a.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return x + self.proj(h)


class TorchGPT(torch.nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = torch.nn.Embedding(c.vocab, c.width)
        self.wpe = torch.nn.Embedding(c.context, c.width) if c.positions == "learned" else None  # nanoGPT's
        self.blocks = torch.nn.ModuleList(TorchBlock(c, layer) for layer in range(c.layers))
        self.ln_f = make_norm(c)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the head is the embedding matrix: tied
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_norm(c: GPTConfig) -> torch.nn.Module:
    if c.norm == "rmsnorm":
        return torch.nn.RMSNorm(c.width, eps=1e-5)
    return torch.nn.LayerNorm(c.width, eps=1e-5, bias=c.bias)


def qwen3_next_delta(c: GPTConfig) -> torch.nn.Module:
    """transformers' Qwen3NextGatedDeltaNet of the GPT's gated delta layers' shape."""
    from test_torch_linear import config, qwen3_next  # needs transformers: a hybrid test skips without it

    return qwen3_next.Qwen3NextGatedDeltaNet(config(shape=c.delta_shape), 0)


def torch_names(c: GPTConfig) -> dict[str, tuple[str, bool]]:
    """Our parameter name -> (the torch model's, whether ours is its transpose)."""
    names = {"wte": ("wte.weight", False), "wpe": ("wpe.weight", False)}
    names |= {"ln_f.gain": ("ln_f.weight", False), "ln_f.bias": ("ln_f.bias", False)}
    for layer in range(c.layers):
        ours, theirs = f"h.{layer}.", f"blocks.{layer}."
        for norm in ("ln_1", "ln_2"):
            names[f"{ours}{norm}.gain"] = (f"{theirs}{norm}.weight", False)
            names[f"{ours}{norm}.bias"] = (f"{theirs}{norm}.bias", False)
        names[ours + "attn.w_qkv"] = (theirs + "attn.qkv.weight", True)
        names[ours + "attn.w_out"] = (theirs + "attn.out.weight", True)
        for w, module in (("fc", "fc"), ("proj", "proj")):
            names[f"{ours}mlp.w_{w}"] = (f"{theirs}{module}.weight", True)
            names[f"{ours}mlp.b_{w}"] = (f"{theirs}{module}.bias", False)
    return names


def torch_model(model: GPT, device: str) -> TorchGPT:
    """A TorchGPT holding model's weights (nn.Linear's the transposes), in model's dtype, on device."""
    c = model.config
    module = TorchGPT(c).to(device=device, dtype=getattr(torch, c.dtype))
    theirs = dict(module.named_parameters())
    names = {ours: names for ours, names in torch_names(c).items() if ours in model.params}
    deltas = [layer for layer in range(c.layers) if c.layer_kind(layer) == "L"]
    in_deltas = {name for name in theirs if any(name.startswith(f"blocks.{layer}.attn.") for layer in deltas)}
    assert sorted(set(theirs) - in_deltas) == sorted(name for name, _ in names.values()), "the parameters differ"
    with torch.no_grad():
        for ours, (name, transposed) in names.items():
            value = model.params[ours].T if transposed else model.params[ours]
            theirs[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
    for layer in deltas:
        from test_torch_linear import load_qwen3_next

        load_qwen3_next(module.blocks[layer].attn, delta_weights(model.params, layer), c.delta_shape)
    return module


def delta_weights(params: dict[str, np.ndarray], layer: int) -> GatedDeltaNetWeights:
    return GatedDeltaNetWeights(*(params[f"h.{layer}.delta.{name}"] for name in GatedDeltaNetWeights._fields))


def torch_weights(module: TorchGPT, model: GPT, grad: bool = False) -> dict[str, np.ndarray]:
    """module's weights (or with grad=True their gradients) under our names and in our layout."""
    theirs, c = dict(module.named_parameters()), model.config
    out = {}
    for ours, (name, transposed) in torch_names(c).items():
        if ours in model.params:
            value = (theirs[name].grad if grad else theirs[name]).detach().cpu().numpy()
            out[ours] = value.T if transposed else value
    for layer in (layer for layer in range(c.layers) if c.layer_kind(layer) == "L"):
        from test_torch_linear import weights_of_qwen3_next

        weights = weights_of_qwen3_next(module.blocks[layer].attn, c.delta_shape, grad=grad)
        out |= {f"h.{layer}.delta.{name}": value for name, value in weights._asdict().items()}
    return out


def torch_adamw(module: TorchGPT) -> torch.optim.AdamW:
    """torch's AdamW as ours is set up here: lr LR, betas (0.9, 0.95), eps 1e-8, decay 0.1 on matrices only."""
    decay = [p for p in module.parameters() if p.ndim >= 2]  # matrices only, as ours
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def batches(c: GPTConfig, batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """STEPS batches of (idx, targets) (batch, context) cut from one token stream with structure to learn
    (a repeating pattern with noise), so that the loss falls over the steps."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, c.vocab, 17)
    stream = np.resize(pattern, 4096)
    noise = rng.random(stream.size) < 0.2
    stream[noise] = rng.integers(0, c.vocab, int(noise.sum()))
    out = []
    for _ in range(STEPS):
        starts = rng.integers(0, stream.size - c.context - 1, batch)
        idx = np.stack([stream[s : s + c.context] for s in starts])
        out.append((idx, np.stack([stream[s + 1 : s + c.context + 1] for s in starts])))
    return out


def gpt_of(c: GPTConfig, seed: int) -> GPT:
    """GPT(c, rng=seed), its gated delta layers' decays slowed to A = e^A_log in (0.1, 1): at initialisation A
    reaches 16, and a head that forgets everything at every token has decay gradients of rounding noise alone,
    which Adam's m̂ / √v̂ turns into steps of lr in either direction (in float32, differently in each model)."""
    model, rng = GPT(c, rng=seed), np.random.default_rng(seed + 100)
    for name, param in model.params.items():
        if name.endswith("delta.a_log"):
            param[...] = np.log(rng.uniform(0.1, 1.0, param.shape))
    return model


def train_both(c: GPTConfig, device: str, batch: int = 4) -> tuple[list[float], list[float], GPT, TorchGPT, list]:
    """10 steps of each: the same weights, batches, schedule, clipping and AdamW; the losses, both models,
    and our gradient norms before clipping."""
    model = gpt_of(c, 0)
    module = torch_model(model, device)
    opt = AdamW(model.params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt = torch_adamw(module)
    ours, theirs, norms = [], [], []
    for step, (idx, targets) in enumerate(batches(c, batch, seed=1)):
        lr = warmup_cosine_lr(step, lr=LR, warmup=WARMUP, total=STEPS, min_lr=LR / 10)
        loss, grads = model.loss_and_grads(idx, targets)
        norms.append(clip_grad_norm(grads, CLIP))
        opt.step(model.params, grads, lr=lr)
        ours.append(loss)

        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.zero_grad()
        loss_t = module(torch.from_numpy(idx).to(device), torch.from_numpy(targets).to(device))
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        torch_opt.step()
        theirs.append(loss_t.item())
    return ours, theirs, model, module, norms


CONFIGS = {
    "layernorm gelu bias": GPTConfig(vocab=23, context=16, layers=2, heads=2, width=32, bias=True),
    "rmsnorm swiglu": GPTConfig(vocab=23, context=16, layers=2, heads=4, width=32, mlp="swiglu", norm="rmsnorm"),
    "tiny preset": GPT_PRESETS["tiny"],
    "hybrid LLA rmsnorm swiglu": GPTConfig(vocab=23, context=16, layers=3, heads=2, width=32, mlp="swiglu",
                                           norm="rmsnorm", layer_pattern="LLA"),
    "tiny preset LLLA": replace(GPT_PRESETS["tiny"], layer_pattern="LLLA"),
    "tiny preset, learned positions": replace(GPT_PRESETS["tiny"], positions="learned"),
}  # fmt: skip


@pytest.fixture
def twin_in(request, monkeypatch):
    """For a hybrid config in float64, transformers' gated delta layer with its float32 casts made float64."""

    def setup(c: GPTConfig) -> None:
        if c.delta_layers and c.dtype == "float64":
            from test_torch_linear import qwen3_next_in_float64

            qwen3_next_in_float64(monkeypatch)

    return setup


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ten_adamw_steps_match_torch(name: str, dtype: str, device: str, twin_in) -> None:
    c = GPTConfig.from_dict(CONFIGS[name].to_dict() | {"dtype": dtype})
    twin_in(c)
    ours, theirs, model, module, norms = train_both(c, device)
    tol = TOLERANCE[dtype]
    assert ours[-1] < ours[0] - 0.1, f"the loss should fall over the steps, so that they test something: {ours}"
    assert max(norms) > CLIP, f"clipping never engaged (norms {norms}): the test would not check it"
    np.testing.assert_allclose(ours, theirs, rtol=tol, atol=0, err_msg=f"{name} {dtype}: losses, step by step")
    gold = torch_weights(module, model)
    for key, mine in model.params.items():
        if dtype == "float64":
            scale = float(np.abs(gold[key]).max())
            np.testing.assert_allclose(mine, gold[key], rtol=0, atol=tol * scale, err_msg=f"{name} {dtype}: {key}")
        else:
            difference = np.linalg.norm(mine - gold[key]) / np.linalg.norm(gold[key])
            tol_weights = HYBRID_FLOAT32 if c.delta_layers else tol
            assert difference <= tol_weights, f"{name} {dtype}: {key} differs from torch's by {difference:.2e}"


@pytest.mark.parametrize("name", ["layernorm gelu bias", "hybrid LLA rmsnorm swiglu", "tiny preset, learned positions"])
def test_gradient_matches_autograd_before_any_step(name, twin_in) -> None:
    """The first step's gradients, every parameter, against torch autograd (float64)."""
    c = GPTConfig.from_dict(CONFIGS[name].to_dict() | {"dtype": "float64"})
    twin_in(c)
    model = gpt_of(c, 3)
    module = torch_model(model, "cpu")
    idx, targets = batches(c, 3, seed=2)[0]
    loss, grads = model.loss_and_grads(idx, targets)
    loss_t = module(torch.from_numpy(idx), torch.from_numpy(targets))
    loss_t.backward()
    assert loss == pytest.approx(loss_t.item(), rel=1e-12)
    golds = torch_weights(module, model, grad=True)
    assert sorted(golds) == sorted(grads)
    for ours, gold in golds.items():
        np.testing.assert_allclose(grads[ours], gold, rtol=0, atol=1e-11 * np.abs(gold).max(), err_msg=ours)
