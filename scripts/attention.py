"""Causal attention on one sentence, checked against a reference at every step.

What it shows, in numbered sections:
  1) one head on "Holmes examined the telegram.": one_head() equals the reference attention(),
     and torch's F.scaled_dot_product_attention(is_causal=True) when torch is installed
  2) the 5x5 attention weights with token labels: rows sum to 1, the future is 0, row 1 is 1.000
  3) multi-head, 4 heads of 64: flash (fused) equals the reference, output shape, 262,144 parameters
  4) the two causal alignments for 2 queries and 5 keys: top-left (torch) vs bottom-right (ours)
  5) the tile map of causal flash attention at T=1024 with 128 x 128 tiles: run, masked, skipped
  6) why the scores are divided by √d: variance and peakiness of the softmax with and without it

Run:  python scripts/attention.py [--seed 0] [--format simple]
Every claim above is checked in code; the exit code is 1 (and the failed checks are named) if one fails.
The weights are random and untrained: the numbers show the mechanics, not meaning.

With --checkpoint DIR (a GPT that train.py --out DIR trained), the trained heads instead:
  7) an induction score per head: on random token sequences repeated once, the mean weight a token of
     the second copy puts on the token after its first occurrence (the one to copy next); uniform
     attention gives about 1 / (the keys it sees), a head that learned to copy much more
  8) one head's weights on the sentence (--head LAYER HEAD; default the highest score's), trained beside
     the same model's random initial weights
Run:  python scripts/attention.py --checkpoint run [--sentence TEXT] [--plot heads.png]
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tinyattn_np import (
    MultiHeadAttention,
    attention,
    causal_mask,
    draw_tile_plan,
    embed,
    flash_attention,
    one_head,
    scaled_dot_product_attention,
    softmax,
    tile_plan,
    tokenize,
)
from tinyattn_np.gpt import GPT  # noqa: E402
from tinyattn_np.gpt import embed as gpt_embed  # noqa: E402
from tinyattn_np.layers import layer_norm, rms_norm  # noqa: E402
from tinyattn_np.report import (  # noqa: E402
    TABLE_WIDTH,
    Checklist,
    add_seed_and_format,
    matrix_table,
    max_diff,
    positive,
    table,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import checkpoint  # noqa: E402
import interrupts
import outputs
import text_data  # noqa: E402
import torch_import
import weight_maps

SENTENCE = "Holmes examined the telegram."
D_MODEL, N_HEADS, D_HEAD = 256, 4, 64
TOL = 1e-5  # float32 results computed in two different orders agree to about 1e-6
COPIES = 2.0  # an induction score this many times uniform attention's: the head copies

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()


def one_head_demo(rng: np.random.Generator, seed: int, fmt: str) -> None:
    print(f"1) one head on {SENTENCE!r}")
    tokens = tokenize(SENTENCE)
    x = embed(tokens, D_MODEL, seed=seed)  # (5, 256), float32
    # three random projections; 1/√d_model keeps q, k, v entries near unit variance
    wq, wk, wv = ((rng.standard_normal((D_MODEL, D_HEAD)) / np.sqrt(D_MODEL)).astype(np.float32) for _ in range(3))
    out, weights = one_head(x, wq, wk, wv)  # (5, 64), (5, 5)
    print(f"   {len(tokens)} tokens: {tokens}")
    print(f"   x {x.shape} {x.dtype} -> one head of {D_HEAD} -> out {out.shape}, weights {weights.shape}")

    q, k, v = x @ wq, x @ wk, x @ wv  # (5, 64) each
    ref = attention(q, k, v, causal=True)  # (5, 64)
    diff = max_diff(out, ref)
    print(f"   max |one_head - attention(causal=True)| = {diff:.1e}")
    check(diff < TOL, f"one_head equals attention() within {TOL:g}")

    torch = torch_import.optional_torch()  # tinyattn_np never needs it; here it is one more witness
    if torch is None:
        print(
            f"   torch checks skipped (here and in 4): torch is not installed; its CPU build adds them:\n"
            f"   {torch_import.TORCH_INSTALL_HINT}"
        )
    else:
        import torch.nn.functional as F

        gold = F.scaled_dot_product_attention(*(torch.from_numpy(t)[None] for t in (q, k, v)), is_causal=True)[
            0
        ].numpy()  # (5, 64)
        diff = max_diff(out, gold)
        print(
            f"   max |one_head - torch F.scaled_dot_product_attention(is_causal=True)| = {diff:.1e}"
            f"  (torch {torch.__version__})"
        )
        check(diff < TOL, f"one_head equals torch SDPA within {TOL:g}")

    print("\n2) attention weights (row = the token doing the looking; random, untrained weights)")
    labels = [repr(t) for t in tokens]
    print(matrix_table(weights, labels, fmt=fmt, digits=3))
    row_sums = weights.sum(axis=-1)  # (5,)
    future = weights[np.triu_indices(len(tokens), k=1)]  # the entries above the diagonal
    print(f"   row sums: {np.array2string(row_sums, precision=6)}; largest weight on a future token: {future.max():g}")
    check(bool(np.allclose(row_sums, 1.0, atol=1e-6)), "every row of the weights sums to 1")
    check(bool(np.all(future == 0.0)), "the upper triangle (the future) is exactly 0")
    check(bool(abs(weights[0, 0] - 1.0) < 1e-6), "the first token sees only itself: row 1 is 1.000")


def multihead_demo(rng: np.random.Generator, seed: int) -> None:
    print(f"\n3) multi-head: {N_HEADS} heads of {D_MODEL // N_HEADS}, one qkv matmul")
    mha = MultiHeadAttention(D_MODEL, N_HEADS, rng=rng)
    x = embed(tokenize(SENTENCE), D_MODEL, seed=seed)[None]  # (1, 5, 256): a batch of one
    fused = mha(x, fused=True)  # flash_attention inside
    unfused = mha(x, fused=False)  # the reference attention(), score matrix and all
    diff = max_diff(fused, unfused)
    n_params = mha.num_parameters
    print(
        f"   w_qkv {mha.w_qkv.shape} + w_out {mha.w_out.shape} = {n_params:,} params"
        f" (3·256·256 + 256·256 = 4·256·256 = {4 * D_MODEL * D_MODEL:,})"
    )
    print(f"   input {x.shape} -> output {fused.shape}; max |fused - unfused| = {diff:.1e}")
    check(diff < TOL, f"fused multi-head equals unfused within {TOL:g}")
    check(fused.shape == x.shape, "multi-head output has the input's shape (1, 5, 256)")
    check(n_params == 262_144, "MultiHeadAttention(256, 4) has 262,144 parameters")


def grid(mask: np.ndarray) -> list[str]:
    return [" ".join(str(int(m)) for m in row) for row in mask]


def alignment_demo(rng: np.random.Generator) -> None:
    n_q, n_k = 2, 5  # two new queries after three cached keys
    print(f"\n4) causal alignment with L={n_q} queries and S={n_k} keys (1 = may attend)")
    top_left = causal_mask(n_q, n_k, align="top_left")  # (2, 5): query i sees j <= i
    bottom_right = causal_mask(n_q, n_k, align="bottom_right")  # (2, 5): query i sees j <= i + S - L
    left_title, right_title = "top_left: torch is_causal=True", "bottom_right: attention(causal=True)"
    width = max(len(left_title), 9) + 4
    print(f"   {left_title:<{width}}{right_title}")
    for left, right in zip(grid(top_left), grid(bottom_right), strict=True):
        print(f"   {left:<{width}}{right}")
    print("   bottom-right lets the newest query see every key, as decoding with a KV cache needs;")
    print("   with L == S the two are the same lower triangle")

    q = rng.standard_normal((n_q, D_HEAD))  # (2, 64)
    k, v = rng.standard_normal((2, n_k, D_HEAD))  # (5, 64) each
    ours = attention(q, k, v, causal=True)  # (2, 64)
    sdpa = scaled_dot_product_attention(q, k, v, is_causal=True)  # (2, 64)
    check(
        max_diff(ours, attention(q, k, v, mask=bottom_right)) == 0.0,
        "attention(causal=True) uses the bottom-right mask",
    )
    check(
        max_diff(sdpa, attention(q, k, v, mask=top_left)) == 0.0,
        "scaled_dot_product_attention(is_causal=True) uses the top-left mask",
    )
    check(max_diff(ours, sdpa) > 0.1, "the two alignments give different outputs when L != S")
    torch = torch_import.optional_torch()
    if torch is not None:
        import torch.nn.functional as F

        gold = F.scaled_dot_product_attention(*(torch.from_numpy(t) for t in (q, k, v)), is_causal=True)
        diff = max_diff(sdpa, gold.numpy())
        print(f"   torch's is_causal=True at L={n_q}, S={n_k} matches the top-left grid: max diff {diff:.1e}")
        check(diff < TOL, "torch SDPA(is_causal=True) is top-left aligned, like scaled_dot_product_attention")


def tile_demo(rng: np.random.Generator, fmt: str) -> None:
    T, block = 1024, 128
    print(
        f"\n5) causal flash attention at T={T} in {block} x {block} tiles"
        " ('#' full tile, '\\' diagonal tile with a mask, '.' skipped)"
    )
    tiles = tile_plan(T, T, block, block, causal=True)
    print("\n".join("   " + line for line in draw_tile_plan(tiles, T, T, block, block).splitlines()))
    n_total = (T // block) ** 2
    n_diagonal = sum(t.kind == "partial" for t in tiles)
    n_full = len(tiles) - n_diagonal
    n_skipped = n_total - len(tiles)
    computed = sum((t.q_stop - t.q_start) * (t.k_stop - t.k_start) for t in tiles)
    rows = [
        ["run, full (no mask)", n_full],
        ["run, diagonal (masked)", n_diagonal],
        ["skipped (wholly in the future)", n_skipped],
        ["total", n_total],
    ]
    print(table(rows, ["tiles", "count"], fmt=fmt))
    print(
        f"   scores computed: {computed:,} of {T * T:,} ({computed / (T * T):.0%}); the unmasked"
        f" triangle alone is {T * (T + 1) // 2:,}"
    )
    check(n_diagonal == T // block, "one diagonal tile per row of tiles")
    check(n_skipped == n_full, "as many tiles skipped as run in full (half the off-diagonal tiles)")

    q, k, v = rng.standard_normal((3, T, D_HEAD)).astype(np.float32)  # (1024, 64) each: one head
    flash = flash_attention(q, k, v, causal=True, block_q=block, block_k=block)  # (1024, 64)
    diff = max_diff(flash, attention(q, k, v, causal=True))
    print(f"   one head, E={D_HEAD}, float32: max |flash_attention - attention| = {diff:.1e}")
    check(diff < TOL, f"flash_attention equals attention at T={T} within {TOL:g}")


def scale_demo(rng: np.random.Generator, fmt: str) -> None:
    n, d = 512, D_HEAD
    print(f"\n6) why divide by √d: {n} queries x {n} keys, unit-normal entries, d={d}")
    q = rng.standard_normal((n, d))  # (512, 64)
    k = rng.standard_normal((n, d))  # (512, 64)
    raw = q @ k.T  # (512, 512): each a sum of 64 products of variance 1, so variance 64
    scaled = raw / np.sqrt(d)  # (512, 512): variance 64 / 8² = 1
    peak_raw = softmax(raw).max(axis=-1).mean()  # mean over rows of the largest weight
    peak_scaled = softmax(scaled).max(axis=-1).mean()
    rows = [["q·k", raw.var(), peak_raw], [f"q·k / √{d}", scaled.var(), peak_scaled]]
    print(table(rows, ["scores", "variance", "mean largest weight per row"], fmt=fmt, floatfmt=".3f"))
    print(f"   unscaled, the top key takes {peak_raw:.0%} of its row on average: near one-hot, tiny gradients")
    print(f"   scaled, the top key gets {peak_scaled:.1%}: spread out (uniform would be {1 / n:.1%})")
    check(48 < raw.var() < 80, f"variance of q·k is about {d}")
    check(0.75 < scaled.var() < 1.25, "variance of q·k/√d is about 1")
    check(peak_raw > 0.5 > 0.1 > peak_scaled, "softmax is peaked without the scale and spread with it")


# ---------------------------------------------------------------------------------------------------
# --checkpoint: what training changed


def layer_inputs(model: GPT, idx: np.ndarray) -> list[np.ndarray]:
    """What each layer's attention reads, Norm_1 of the residual stream before it: (B, T, C) per layer.
    The stream before layer l is what the model's first l blocks make; GPT.hidden of a model cut after
    them, with layer l's Norm_1 as its final norm, is that norm's output."""
    c, p = model.config, model.params
    inputs = []
    for layer in range(c.layers):
        norm = {f"ln_f.{k}": p[f"h.{layer}.ln_1.{k}"] for k in ("gain", "bias") if f"h.{layer}.ln_1.{k}" in p}
        if layer == 0:  # no block before it: the norm of the embeddings (and of the position table's rows)
            x = gpt_embed(p, c, idx).reshape(*idx.shape, c.width)  # (B, T, C)
            gain, bias = norm["ln_f.gain"], norm.get("ln_f.bias")
            normed = rms_norm(x, gain) if c.norm == "rmsnorm" else layer_norm(x, gain, bias)
            inputs.append(normed[0])
            continue
        kept = [
            name for name in p if name in ("wte", "wpe") or (name.startswith("h.") and int(name.split(".")[1]) < layer)
        ]
        inputs.append(GPT(replace(c, layers=layer), {name: p[name] for name in kept} | norm).hidden(idx))
    return inputs


def head_weights(model: GPT, idx: np.ndarray) -> list[np.ndarray]:
    """The attention weights of every layer, (B, H, T, T) each, on tokens idx (B, T): softmax of the
    scores of q and k (after RoPE, unless the model has a learned position table), causal, as the layer
    computes them."""
    c, weights = model.config, []
    for layer, h in enumerate(layer_inputs(model, idx)):
        mha = MultiHeadAttention(c.width, c.heads, rope=c.positions == "rope", rng=0, dtype=c.dtype)
        mha.w_qkv, mha.w_out = model.params[f"h.{layer}.attn.w_qkv"], model.params[f"h.{layer}.attn.w_out"]
        q, k, v = mha.split_heads(h)  # (B, H, T, d) each
        out, w = attention(q, k, v, causal=True, return_weights=True)  # (B, H, T, d), (B, H, T, T)
        # the weights are the layer's own: with them the layer's output is what MultiHeadAttention gives
        merged = out.swapaxes(1, 2).reshape(h.shape) @ mha.w_out  # (B, T, C)
        check(max_diff(merged, mha(h, causal=True)) < 1e-4, f"layer {layer}'s weights give its output")
        weights.append(np.asarray(w))
    return weights


def induction_scores(model: GPT, n: int, sequences: int, seed: int) -> np.ndarray:
    """(layers, heads): on `sequences` random sequences of n tokens repeated once, the mean weight from the
    second copy's token at n + i to the key at i + 1, the token that followed its first occurrence."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, model.config.vocab, (sequences, n))  # (S, n)
    idx = np.concatenate([first, first], axis=1)  # (S, 2n)
    queries = np.arange(n, 2 * n)  # (n,): the second copy
    return np.stack([w[:, :, queries, queries - n + 1].mean(axis=(0, 2)) for w in head_weights(model, idx)])


def token_labels(tokenizer: Any, ids: np.ndarray) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def sentence_demo(model: GPT, untrained: GPT, tokenizer: Any, args: argparse.Namespace, head: tuple[int, int]) -> None:
    layer, h = head
    idx = tokenizer.encode(args.sentence)[None]  # (1, T)
    labels = token_labels(tokenizer, idx[0])
    title = (
        f"8) layer {layer}, head {h} on {args.sentence!r} ({idx.shape[1]} tokens): trained, then the same model "
        "at its random initial weights (row = the token doing the looking)"
    )
    print("\n" + textwrap.fill(title, TABLE_WIDTH, subsequent_indent="   "))
    for name, m in (("trained", model), ("random", untrained)):
        weights = head_weights(m, idx)[layer][0, h]  # (T, T)
        check(bool(np.allclose(weights.sum(-1), 1, atol=1e-5)), f"{name}: every row of the weights sums to 1")
        if len(labels) <= 12:
            print(f"{name}:\n" + matrix_table(weights, [repr(t) for t in labels], fmt=args.format, digits=3))
        else:
            symbols = "".join(t if len(t) == 1 and t.isprintable() else "?" for t in labels)
            print(
                f"{name} ('{weight_maps.SHADES}' = weight 0 .. 1):\n"
                + weight_maps.heat_map(weights, np.arange(len(labels)), symbols)
            )


def induction_demo(model: GPT, untrained: GPT, args: argparse.Namespace) -> tuple[int, int]:
    """Section 7; returns the (layer, head) that copies best."""
    n = args.repeat or model.config.context // 2
    uniform = float(np.mean(1 / np.arange(n + 1, 2 * n + 1)))  # query n + i spread over its n + i + 1 keys
    title = (
        f"7) induction score per head: {args.sequences} random sequences of {n} tokens, each repeated once; "
        f"the mean weight from the second copy's tokens to the token after their first occurrence "
        f"(uniform attention: about {uniform:.3f})"
    )
    print("\n" + textwrap.fill(title, TABLE_WIDTH, subsequent_indent="   "))
    trained = induction_scores(model, n, args.sequences, args.seed)
    random = induction_scores(untrained, n, args.sequences, args.seed)
    rows = [[layer, h, trained[layer, h], random[layer, h]] for layer, h in np.ndindex(trained.shape)]
    print(table(rows, ["layer", "head", "trained", "random weights"], fmt=args.format, floatfmt=".3f"))
    best = np.unravel_index(int(np.argmax(trained)), trained.shape)
    score = f"layer {best[0]}, head {best[1]} ({trained[best]:.3f}; at its random weights {random[best]:.3f})"
    if trained[best] > COPIES * uniform:
        verdict = f"the best copier: {score}"
    else:
        verdict = f"no head has learned to copy: the highest score, {score}, is within {COPIES}x uniform attention's"
    print(textwrap.fill(verdict, TABLE_WIDTH, initial_indent="   ", subsequent_indent="   "))
    if args.plot:
        plot_scores(trained, random, n, args.plot)
        print(f"   plot written to {args.plot}")
    return int(best[0]), int(best[1])


def plot_scores(trained: np.ndarray, random: np.ndarray, n: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 1.5 + 0.7 * trained.shape[0]), layout="constrained")
    for ax, scores, name in ((axes[0], trained, "trained"), (axes[1], random, "random initial weights")):
        image = ax.imshow(scores, cmap="Blues", vmin=0, vmax=max(float(trained.max()), 0.1))
        for (layer, head), score in np.ndenumerate(scores):
            ax.text(head, layer, f"{score:.2f}", ha="center", va="center", fontsize=10)
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(scores.shape[1]))
        ax.set_yticks(range(scores.shape[0]))
    fig.colorbar(image, ax=axes, label="induction score")
    fig.suptitle(f"induction score: weight on the token after the first occurrence ({n} random tokens, repeated)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trained_demo(args: argparse.Namespace) -> int:
    try:
        model, tokenizer, meta, _ = checkpoint.load_model(args.checkpoint)
        tokenizer.encode(args.sentence)
    except (checkpoint.CheckpointError, text_data.DataError) as err:
        print(
            f"attention.py: error: {'--sentence: ' if isinstance(err, text_data.DataError) else ''}{err}",
            file=sys.stderr,
        )
        return 2
    c = model.config
    if c.layer_pattern is not None and "L" in c.layer_pattern:
        print(
            f"attention.py: error: the model's layer pattern {c.layer_pattern} has gated delta layers (L), which "
            "weigh no keys: there are attention weights to show only where every layer is softmax attention (A)",
            file=sys.stderr,
        )
        return 2
    if args.head is not None and not (0 <= args.head[0] < c.layers and 0 <= args.head[1] < c.heads):
        print(
            f"attention.py: error: --head {args.head[0]} {args.head[1]}: the model has {c.layers} layers of "
            f"{c.heads} heads (numbered from 0)",
            file=sys.stderr,
        )
        return 2
    if args.repeat is not None and 2 * args.repeat > c.context:
        print(
            f"attention.py: error: --repeat {args.repeat} twice is more than the model's context ({c.context})",
            file=sys.stderr,
        )
        return 2
    print(f"checkpoint {args.checkpoint}")  # a path of any length, on a line of its own
    print(f"  step {meta['step']}, {c.layers} layers x {c.heads} heads, width {c.width}")
    # the weights this run started from (train.py draws them from --seed)
    untrained = GPT(c, rng=meta["seed"])
    best = induction_demo(model, untrained, args)
    sentence_demo(model, untrained, tokenizer, args, best if args.head is None else tuple(args.head))
    return check.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="One causal attention head on 'Holmes examined the telegram.', its weight table, "
        "multi-head, the two causal alignments, the tiles flash attention skips, and why scores are "
        "divided by √d; every claim is checked (exit 1 if one fails).",
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="show the trained heads of train.py --out DIR instead")
    parser.add_argument("--sentence", default=SENTENCE, help=f"with --checkpoint: the text (default {SENTENCE!r})")
    parser.add_argument(
        "--repeat",
        type=positive(int),
        help="with --checkpoint: the random tokens before the repeat (default: half the context)",
    )
    parser.add_argument(
        "--head",
        type=int,
        nargs=2,
        metavar=("LAYER", "HEAD"),
        help="with --checkpoint: the head that 8) shows (default: the best copier)",
    )
    parser.add_argument(
        "--sequences",
        type=positive(int),
        default=32,
        help="with --checkpoint: random sequences for the induction score (default 32)",
    )
    outputs.add_plot_arguments(parser, "the induction scores (with --checkpoint)")
    add_seed_and_format(parser, "the random weights and inputs")
    args = parser.parse_args(argv)
    if args.sequences > 4096:
        parser.error(f"--sequences must be at most 4,096; got {args.sequences:,}")
    outputs.check_plot(parser, args.plot, args.overwrite)
    if args.checkpoint:
        return trained_demo(args)
    rng = np.random.default_rng(args.seed)

    one_head_demo(rng, args.seed, args.format)
    multihead_demo(rng, args.seed)
    alignment_demo(rng)
    tile_demo(rng, args.format)
    scale_demo(rng, args.format)

    return check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
