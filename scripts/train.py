"""A tiny model learns to attend: NumPy forward, hand-written backward, Adam, nothing else.

    python scripts/train.py                        # about half a minute on 2 cores
    python scripts/train.py --plot docs/train.png  # and draw the attention before and after
    python scripts/train.py --no-fused             # the reference attention instead of flash

The task (induction, or "copy the token a fixed distance back"): a sequence of --length random tokens is
followed by the same tokens again. In the second copy, the next token is always the one that followed
this token's first occurrence, --length - 1 positions back. Nothing in a single token tells it what comes
next: only attention to the right earlier position can, and RoPE makes "n positions back" learnable.

The model, all of it:
    h = E[tokens]                                  (B, T, C)  token embeddings, no position table
    h = h + MultiHeadAttention(h)  (--layers times) (B, T, C)  causal, RoPE on q and k, a residual
    logits = h W_head                              (B, T, V)
    loss = cross-entropy of logits against the next token, over the second copy's positions
The gradients go back through the same lines (MultiHeadAttention.backward does the attention), and
Adam (Kingma & Ba 2015) updates the weights. --check first compares every gradient of a tiny float64
model with central finite differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from tinyattn_np import MultiHeadAttention, attention
from tinyattn_np.report import add_format_argument, nonnegative_seed, positive, text_table

SHADES = " .:-=+*#%@"  # the heat map's characters, light to heavy


# ---------------------------------------------------------------------------------------------------
# the data


def make_batch(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """(batch, 2·length) int tokens: length random tokens, then the same tokens again."""
    first = rng.integers(0, vocab, (batch, length))  # (B, n)
    return np.concatenate([first, first], axis=1)  # (B, 2n)


def scored_positions(length: int) -> np.ndarray:
    """The positions whose next token can be known: the second copy's, up to the last but one.
    Position p in length .. 2·length - 2 predicts token p + 1, which is token p + 1 - length."""
    return np.arange(length, 2 * length - 1)


# ---------------------------------------------------------------------------------------------------
# the model


class TinyModel:
    """Token embeddings, --layers residual MultiHeadAttention layers with RoPE, an output projection."""

    def __init__(
        self, vocab: int, d_model: int, heads: int, kv_heads: int, layers: int, rng: np.random.Generator, dtype: Any
    ):
        self.embed = rng.standard_normal((vocab, d_model)).astype(dtype)  # (V, C)
        self.layers = [
            MultiHeadAttention(d_model, heads, kv_heads, rope=True, rng=rng, dtype=dtype) for _ in range(layers)
        ]
        bound = 1 / np.sqrt(d_model)  # nn.Linear's default range, as MultiHeadAttention uses
        self.w_head = rng.uniform(-bound, bound, (d_model, vocab)).astype(dtype)  # (C, V)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every weight, by name; the optimiser and the gradient check walk this."""
        params = {"embed": self.embed, "w_head": self.w_head}
        for i, layer in enumerate(self.layers):
            params[f"layer{i}.w_qkv"], params[f"layer{i}.w_out"] = layer.w_qkv, layer.w_out
        return params

    def loss_and_grads(self, tokens: np.ndarray, length: int, fused: bool) -> tuple[float, dict[str, np.ndarray]]:
        """Cross-entropy over the scored positions, and its gradient for every parameter."""
        B, T = tokens.shape
        rows = scored_positions(length)  # (P,)
        targets = tokens[:, rows + 1]  # (B, P)
        # forward: 1) embed  2) attention layers with residuals  3) logits  4) cross-entropy
        h = self.embed[tokens]  # (B, T, C)
        saved = []
        for layer in self.layers:
            out, s = layer.forward(h, causal=True, fused=fused)  # (B, T, C)
            saved.append(s)
            h = h + out
        logits = h[:, rows] @ self.w_head  # (B, P, V)
        logits = logits - logits.max(axis=-1, keepdims=True)  # log-softmax without overflow
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))  # (B, P, V)
        picked = np.take_along_axis(log_probs, targets[..., None], axis=-1)  # (B, P, 1)
        n = B * len(rows)
        loss = float(-picked.sum() / n)

        # backward, the same lines in reverse
        # 4) d loss / d logits = (softmax - one_hot) / n
        dlogits = np.exp(log_probs)  # (B, P, V)
        np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
        dlogits /= n
        # 3) logits = h W_head, at the scored positions only
        grads = {"w_head": h[:, rows].reshape(-1, h.shape[-1]).T @ dlogits.reshape(-1, dlogits.shape[-1])}
        dh = np.zeros_like(h)  # (B, T, C)
        dh[:, rows] = dlogits @ self.w_head.T
        # 2) h + layer(h): the residual passes dh straight through and adds the layer's dx
        for i in reversed(range(len(self.layers))):
            dx, grads[f"layer{i}.w_qkv"], grads[f"layer{i}.w_out"] = self.layers[i].backward(dh, saved[i])
            dh = dh + dx
        # 1) embed[tokens]: a row's gradient is the sum over the places its token sits
        grads["embed"] = np.zeros_like(self.embed)
        np.add.at(grads["embed"], tokens, dh)
        return loss, grads

    def evaluate(self, tokens: np.ndarray, length: int) -> tuple[float, float]:
        """(loss, accuracy of the most likely next token) over the scored positions, no gradients."""
        rows = scored_positions(length)
        h = self.embed[tokens]
        for layer in self.layers:
            h = h + layer(h, causal=True)
        logits = h[:, rows] @ self.w_head  # (B, P, V)
        logits = logits - logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        targets = tokens[:, rows + 1]
        loss = float(-np.take_along_axis(log_probs, targets[..., None], axis=-1).mean())
        return loss, float((log_probs.argmax(axis=-1) == targets).mean())

    def attention_weights(self, tokens: np.ndarray, layer: int) -> np.ndarray:
        """(H, T, T) attention weights of one sequence (T,) in the given layer."""
        h = self.embed[tokens[None]]  # (1, T, C)
        for i in range(layer):
            h = h + self.layers[i](h, causal=True)
        q, k, v = self.layers[layer].split_heads(h)  # rotated by RoPE, as the layer sees them
        _, weights = attention(q, k, v, causal=True, return_weights=True)  # (1, H, T, T)
        return np.asarray(weights[0])


class Adam:
    """m ← β1·m + (1 − β1)·g,  v ← β2·v + (1 − β2)·g²,  w ← w − lr · m̂ / (√v̂ + ε)  (Kingma & Ba 2015),
    with m̂ = m / (1 − β1^t) and v̂ = v / (1 − β2^t) correcting the zero start."""

    def __init__(self, params: dict[str, np.ndarray], lr: float, beta1: float = 0.9, beta2: float = 0.999):
        self.params, self.lr, self.beta1, self.beta2, self.eps = params, lr, beta1, beta2, 1e-8
        self.m = {name: np.zeros_like(w) for name, w in params.items()}
        self.v = {name: np.zeros_like(w) for name, w in params.items()}
        self.t = 0

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        for name, w in self.params.items():
            g = grads[name]
            self.m[name] = self.beta1 * self.m[name] + (1 - self.beta1) * g
            self.v[name] = self.beta2 * self.v[name] + (1 - self.beta2) * g * g
            m_hat = self.m[name] / (1 - self.beta1**self.t)
            v_hat = self.v[name] / (1 - self.beta2**self.t)
            w -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(w.dtype)  # in place: the model's arrays


# ---------------------------------------------------------------------------------------------------
# the gradient check


def gradient_check(layers: int, fused: bool, seed: int) -> float:
    """max |analytic − central difference| over every parameter of a tiny float64 model (vocab 5,
    3 + 3 tokens, d_model 8, 2 query heads sharing 1 kv head, --layers layers)."""
    rng = np.random.default_rng(seed)
    model = TinyModel(vocab=5, d_model=8, heads=2, kv_heads=1, layers=layers, rng=rng, dtype=np.float64)
    tokens = make_batch(rng, 2, 3, 5)
    _, grads = model.loss_and_grads(tokens, 3, fused)
    worst, eps = 0.0, 1e-6
    for name, w in model.parameters().items():
        for i in np.ndindex(w.shape):
            old = w[i]
            w[i] = old + eps
            up = model.loss_and_grads(tokens, 3, fused)[0]
            w[i] = old - eps
            down = model.loss_and_grads(tokens, 3, fused)[0]
            w[i] = old
            worst = max(worst, abs((up - down) / (2 * eps) - grads[name][i]))
    return worst


# ---------------------------------------------------------------------------------------------------
# printing


def heat_map(weights: np.ndarray, tokens: np.ndarray, symbols: str) -> str:
    """One character per weight (SHADES, light to heavy), a row per query, labelled with its token."""
    labels = "".join(symbols[t] for t in tokens)
    lines = ["       keys " + labels]  # 12 characters, as the row labels below
    for i, row in enumerate(weights):
        cells = "".join(SHADES[min(int(w * len(SHADES)), len(SHADES) - 1)] for w in row[: i + 1])
        lines.append(f"{i:3d} {labels[i]}  |    {cells}")
    return "\n".join(lines)


def induction_weight(weights: np.ndarray, length: int) -> float:
    """The mean weight the second copy's queries put on the key length − 1 back (the token to copy)."""
    rows = scored_positions(length)
    return float(weights[..., rows, rows - length + 1].mean())


def plot(before: np.ndarray, after: np.ndarray, tokens: np.ndarray, symbols: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [symbols[t] for t in tokens]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 4.2))
    for ax, weights, name in ((axes[0], before, "before training"), (axes[1], after, "after training")):
        image = ax.imshow(weights, cmap="Blues", vmin=0, vmax=1)
        ax.set_title(name)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("key (token attended to)")
        ax.set_ylabel("query")
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive(int), default=200, help="Adam steps (default 200)")
    p.add_argument("--batch", type=positive(int), default=32, help="sequences per step (default 32)")
    p.add_argument("--length", type=positive(int), default=12, help="random tokens before the repeat (default 12)")
    p.add_argument("--vocab", type=positive(int), default=16, help="distinct tokens, at most 62 (default 16)")
    p.add_argument("--d-model", type=positive(int), default=32, help="model width C (default 32)")
    p.add_argument("--heads", type=positive(int), default=2, help="query heads per layer (default 2)")
    p.add_argument("--kv-heads", type=positive(int), default=None, help="key/value heads (default: --heads)")
    p.add_argument("--layers", type=positive(int), default=1, help="attention layers (default 1)")
    p.add_argument("--lr", type=positive(float), default=0.005, help="Adam's learning rate (default 0.005)")
    p.add_argument("--eval-every", type=positive(int), default=25, help="steps between table rows (default 25)")
    p.add_argument(
        "--fused", action=argparse.BooleanOptionalAction, default=True,
        help="flash_attention and its blockwise backward (default); --no-fused: the reference attention()",
    )  # fmt: skip
    p.add_argument(
        "--check", action=argparse.BooleanOptionalAction, default=True,
        help="compare every gradient of a tiny float64 model with finite differences first (default on)",
    )  # fmt: skip
    p.add_argument("--plot", metavar="PATH.png", help="draw the attention before and after (needs the plot extra)")
    p.add_argument("--json", metavar="PATH", help="write the table's figures to PATH")
    p.add_argument(
        "--seed", type=nonnegative_seed, default=0, help="seed for data and weights, an int >= 0 (default 0)"
    )
    add_format_argument(p)
    args = p.parse_args(argv)
    if args.vocab > 62:
        p.error(f"--vocab must be at most 62 (one character per token in the heat map); got {args.vocab}")
    if args.length < 2:
        p.error(f"--length must be at least 2 (the second copy needs a token to predict); got {args.length}")
    if args.length > 256 or args.batch > 4096 or args.d_model > 1024 or args.layers > 8:
        p.error("sizes this large would not finish on a CPU: keep --length <= 256, --batch <= 4096, "
                "--d-model <= 1024, --layers <= 8")  # fmt: skip
    kv_heads = args.kv_heads or args.heads
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error(f"--d-model ({args.d_model}) must split into --heads ({args.heads}) heads of an even size (RoPE)")
    if args.heads % kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})")
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        if path is not None and os.path.isdir(path):
            p.error(f"{flag} {path} is a folder: give a file name in it")
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag}: the folder of {path!r} does not exist")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install -e '.[plot]'")
    return args


def train(args: argparse.Namespace, progress: bool = True) -> tuple[TinyModel, list[dict[str, Any]], dict[str, Any]]:
    """Train from args; return the model, the table's rows and the held-out sequence's weights."""
    rng = np.random.default_rng(args.seed)
    kv_heads = args.kv_heads or args.heads
    model = TinyModel(args.vocab, args.d_model, args.heads, kv_heads, args.layers, rng, np.float32)
    held_out = make_batch(np.random.default_rng(args.seed + 1), 256, args.length, args.vocab)  # never trained on
    shown = held_out[0]
    before = [model.attention_weights(shown, i) for i in range(args.layers)]
    optimiser = Adam(model.parameters(), args.lr)
    rows: list[dict[str, Any]] = []
    train_loss: float | None = None
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            loss, accuracy = model.evaluate(held_out, args.length)
            rows.append(dict(step=step, train_loss=train_loss, held_out_loss=loss, held_out_accuracy=accuracy))
            # train_loss: the mean of the last step's batch (none yet at step 0)
        if step == args.steps:
            break
        loss, grads = model.loss_and_grads(
            make_batch(rng, args.batch, args.length, args.vocab), args.length, args.fused
        )
        optimiser.step(grads)
        train_loss = loss
        if progress and (step + 1) % 10 == 0:
            print(f"\r  step {step + 1}/{args.steps}  loss {loss:.3f}  {time.perf_counter() - start:.0f} s",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
    if progress:
        print(file=sys.stderr)
    after = [model.attention_weights(shown, i) for i in range(args.layers)]
    return model, rows, dict(tokens=shown, before=before, after=after)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kv_heads = args.kv_heads or args.heads
    symbols = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    print(
        f"task: {args.length} random tokens of {args.vocab}, then the same {args.length} again; predict the "
        f"second copy's next token (chance {1 / args.vocab:.0%})"
    )
    print(
        f"model: embeddings {args.vocab} x {args.d_model}, {args.layers} x MultiHeadAttention({args.d_model}, "
        f"{args.heads} heads, {kv_heads} kv heads, RoPE, causal) + residual, output {args.d_model} x {args.vocab}; "
        f"{'flash_attention + flash_attention_backward' if args.fused else 'attention + attention_backward'}"
    )
    if args.check:
        worst = gradient_check(args.layers, args.fused, args.seed)
        ok = worst < 1e-7
        print(f"gradient check (float64, every weight of a tiny model, central differences): max |error| = "
              f"{worst:.1e} {'ok' if ok else 'FAILED (> 1e-7)'}")  # fmt: skip
        if not ok:
            return 1

    start = time.perf_counter()
    model, rows, shown = train(args)
    seconds = time.perf_counter() - start
    print(f"\nAdam, lr {args.lr}, batch {args.batch}, {args.steps} steps in {seconds:.1f} s; held out: 256 sequences")
    body = [
        [r["step"], "-" if r["train_loss"] is None else f"{r['train_loss']:.3f}", f"{r['held_out_loss']:.3f}",
         f"{r['held_out_accuracy']:.1%}"]
        for r in rows
    ]  # fmt: skip
    print(text_table(body, ["step", "train loss", "held-out loss", "held-out accuracy"], fmt=args.format))

    layer = args.layers - 1
    before, after = shown["before"][layer], shown["after"][layer]
    head = int(np.argmax([induction_weight(w, args.length) for w in after]))  # the head that learned it best
    tokens = shown["tokens"]
    print(
        f"\nattention of layer {layer}, head {head} on one held-out sequence, before and after training "
        f"(row = query, '{SHADES}' = weight 0 .. 1; the token to copy sits {args.length - 1} back):"
    )
    for name, weights in (("before", before[head]), ("after", after[head])):
        print(f"\n{name}: mean weight on the token {args.length - 1} back = "
              f"{induction_weight(weights, args.length):.2f}")  # fmt: skip
        print(heat_map(weights, tokens, symbols))
    if args.plot:
        title = (
            f"layer {layer}, head {head}: {args.length} random tokens, repeated; "
            f"held-out accuracy {rows[-1]['held_out_accuracy']:.0%}"
        )
        plot(before[head], after[head], tokens, symbols, args.plot, title)
        print(f"\nplot written to {args.plot}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "seconds": seconds, "rows": rows}, f, indent=2)
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
