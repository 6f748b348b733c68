"""Our GPT in torch, eager, for train_speed.py: the same architecture (nn.Embedding, the norms, nn.Linear,
RoPE on interleaved pairs, F.scaled_dot_product_attention, a GELU MLP, the head tied to the embedding,
F.cross_entropy), the names of its parameters beside ours, its training step (backward, clip_grad_norm_ to
1.0, AdamW) and torch's AdamW set up as ours is (decay on the matrices only).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from train_flags import Preset

from tinyattn_np.gpt import GPTConfig


def torch_model(torch: Any, c: GPTConfig) -> Any:
    """A torch module of our GPT's architecture (config c), its weights torch's own until copy_weights sets
    ours (nn.Linear's weight is our W transposed)."""
    nn, F = torch.nn, torch.nn.functional
    cos, sin = rope_tables(torch, c)

    def norm() -> Any:
        return nn.LayerNorm(c.width, eps=1e-5, bias=c.bias) if c.norm == "layernorm" else nn.RMSNorm(c.width, eps=1e-5)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = norm(), norm()
            self.qkv, self.out = (
                nn.Linear(c.width, 3 * c.width, bias=False),
                nn.Linear(c.width, c.width, bias=False),
            )
            self.fc, self.proj = (
                nn.Linear(c.width, c.hidden, bias=c.bias),
                nn.Linear(c.hidden, c.width, bias=c.bias),
            )

        def forward(self, x: Any) -> Any:
            B, T, C = x.shape
            q, k, v = (t.view(B, T, c.heads, c.head_dim).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, -1))
            q, k = rotate(torch, q, cos, sin), rotate(torch, k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(B, T, C))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class TorchGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.ln_f = nn.Embedding(c.vocab, c.width), norm()
            self.h = nn.ModuleList(Block() for _ in range(c.layers))

        def forward(self, idx: Any, targets: Any) -> Any:
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return F.cross_entropy((self.ln_f(x) @ self.wte.weight.T).flatten(0, 1), targets.flatten())  # tied

    if c.mlp != "gelu" or c.positions != "rope" or c.layer_pattern is not None:
        sys.exit("train_speed.py: error: the torch twin has the presets' GELU MLP, RoPE and softmax layers only")
    return TorchGPT()


def rope_tables(torch: Any, c: GPTConfig) -> tuple[Any, Any]:
    """cos and sin (T, d/2) of RoPE's angles m θ_i, θ_i = 10000^(-2i/d), as tinyattn_np.rope computes them."""
    theta = 10000.0 ** (-np.arange(0, c.head_dim, 2) / c.head_dim)  # (d/2,)
    angles = np.arange(c.context)[:, None] * theta  # (T, d/2), float64
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def rotate(torch: Any, x: Any, cos: Any, sin: Any) -> Any:
    """RoPE on x (B, H, T, d), pairs (0, 1), (2, 3), ... (interleaved, as tinyattn_np.rope's default)."""
    T = x.shape[-2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, T, d/2) each
    cos, sin = cos[:T], sin[:T]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)  # (B, H, T, d)


MATRICES = {
    "attn.w_qkv": "qkv.weight",
    "attn.w_out": "out.weight",
    "mlp.w_fc": "fc.weight",
    "mlp.w_proj": "proj.weight",
}


def torch_name(name: str) -> tuple[str, bool]:
    """Our parameter's name -> (the torch module's,
    whether ours is its transpose: x @ W is nn.Linear(W.T))."""
    if name == "wte":
        return "wte.weight", False
    for ours, theirs in MATRICES.items():
        if name.endswith(ours):
            return name.replace(ours, theirs), True
    return name.replace(".gain", ".weight").replace("mlp.b_fc", "fc.bias").replace("mlp.b_proj", "proj.bias"), False


def torch_step(torch: Any, module: Any, optimizer: Any, x: Any, y: Any) -> float:
    """The same step in torch, eager."""
    optimizer.zero_grad(set_to_none=True)
    loss = module(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()
    return float(loss.item())


def torch_adamw(torch: Any, module: Any, preset: Preset) -> Any:
    """torch's AdamW as ours is set up: the preset's lr and β2, decay 0.1 on the matrices only."""
    matrices = [p for p in module.parameters() if p.ndim >= 2]
    rest = [p for p in module.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, preset.beta2), eps=1e-8)
