"""The copy task: a tiny model learns to attend. NumPy forward, hand-written backward, Adam, nothing else.

A module that two scripts share: `python scripts/train.py --task copy` trains it on one process, and
`mpiexec -n 2 python scripts/train_parallel.py` with each sequence split over the processes.

    python scripts/train.py --task copy                        # its run timed: docs/results/backward.md
    python scripts/train.py --task copy --plot train.png       # and draw the attention before and after
    python scripts/train.py --task copy --no-fused             # the reference attention instead of flash

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
model with central finite differences. A loss that becomes inf or NaN (a learning rate far too large)
stops the run there, with the table so far and what to change; Ctrl-C stops it with the table so far.
--plot refuses to replace a picture that git tracks (docs/train.png) unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tinyattn_np import naive_attention_bytes
from tinyattn_np.memory import attention_flops
from tinyattn_np.peaks import flash_attention_backward_bytes, flash_attention_bytes
from tinyattn_np.report import add_seed_and_format, positive, text_table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this one shares sit beside it
import interrupts
import limits
import machine
import outputs
from copy_model import SYMBOLS, Adam, TinyModel, gradient_check, make_batch, scored_positions
from weight_maps import SHADES, heat_map

HELD_OUT = 256  # held-out sequences, never trained on


# ---------------------------------------------------------------------------------------------------
# printing


def induction_weight(weights: np.ndarray, length: int) -> float:
    """The mean weight the second copy's queries put on the key length − 1 back (the token to copy)."""
    rows = scored_positions(length)
    return float(weights[..., rows, rows - length + 1].mean())


def plot(before: np.ndarray, after: np.ndarray, tokens: np.ndarray, length: int, path: str, title: str) -> None:
    """The weights before and after training, side by side, with the cells of the token to copy outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    labels = [f"{SYMBOLS[t]}\n{i}" for i, t in enumerate(tokens)]  # the token, and under it its position
    rows = scored_positions(length)  # the queries that can know their next token
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.6), layout="constrained")
    for ax, weights, name in ((axes[0], before, "before training"), (axes[1], after, "after training")):
        image = ax.imshow(weights, cmap="Blues", vmin=0, vmax=1)
        for query in rows:  # the key length - 1 back: the token that followed this one's first occurrence
            ax.add_patch(Rectangle((query - length + 0.5, query - 0.5), 1, 1, fill=False, ec="tab:orange", lw=2))
        ax.axhline(length - 0.5, color="grey", lw=0.8, ls="--")  # the second copy starts below this line
        ax.set_title(name, fontsize=14)
        ax.set_xticks(range(len(labels)), labels, fontsize=9)
        ax.set_yticks(range(len(labels)), [label.replace("\n", " ") for label in labels], fontsize=9)
        ax.set_xlabel("key: the token attended to, and its position", fontsize=12)
        ax.set_ylabel("query: token and position", fontsize=12)
    outline = Rectangle((0, 0), 1, 1, fill=False, ec="tab:orange", lw=2)
    border = Line2D([], [], color="grey", lw=0.8, ls="--")
    names = [f"the token {length - 1} back (the one to copy)", "the second copy starts below"]
    axes[1].legend([outline, border], names, loc="upper right", fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=14)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# the whole run, estimated before it starts


def run_bill(args: argparse.Namespace) -> tuple[int, int]:
    """(peak bytes, FLOPs) of the whole run, from the flags; float32 throughout (4 bytes).

    bytes = the weights four times over (weights, gradients, Adam's m and v)
          + the larger of a training step and an evaluation of the 256 held-out sequences: per layer the
            (B, T, ·) arrays a forward keeps for its backward (x, q, k, v, y and out: 3·C + 2·(H + 2·Hkv)·d
            channels), attention's own working memory (memory.py's estimates; the reference backward's about
            3x its forward's), one layer's gradients in the backward, and the logits four times
    FLOPs = every step's forward and backward (3x the forward) + every evaluation's forward, where one
            sequence's forward = layers · (2·T·C·(H + 2·Hkv)·d + 2·T·C² + causal attention) + 2·P·C·V
    """
    T, P, C, V, L = 2 * args.length, args.length - 1, args.d_model, args.vocab, args.layers
    H, Hkv, d = args.heads, args.kv_heads or args.heads, args.d_model // args.heads
    qkv = (H + 2 * Hkv) * d  # the fused projection's output channels
    sizes = dict(heads=H, kv_heads=Hkv, head_dim=d, dtype="float32", causal=True)

    def pass_bytes(batch: int, backward: bool) -> int:
        kept = batch * T * (3 * C + 2 * qkv) * 4 * (L if backward else 1)  # a backward needs every layer's
        if not args.fused:  # the reference backward builds the weights again, and dP and dS beside them
            working = naive_attention_bytes(T, batch=batch, **sizes) * (3 if backward else 1)
        elif backward:
            working = flash_attention_backward_bytes(T, batch=batch, **sizes)
        else:
            working = flash_attention_bytes(T, batch=batch, **sizes)
        gradients = batch * T * (4 * C + qkv) * 4 if backward else 0  # dh, dout, dy, dx and d(qkv) of a layer
        return kept + working + gradients + 4 * batch * P * V * 4

    weights = 2 * V * C + L * (C * qkv + C * C)
    peak = 4 * weights * 4 + max(pass_bytes(args.batch, True), pass_bytes(HELD_OUT, False))
    attention = attention_flops(T, heads=H, head_dim=d, causal=True)
    forward = L * (2 * T * C * qkv + 2 * T * C * C + attention) + 2 * P * C * V
    return peak, args.steps * 3 * args.batch * forward + len(table_steps(args)) * HELD_OUT * forward


def check_run(args: argparse.Namespace, script: str) -> None:
    """Refuse, before anything runs, a run that needs more memory than this machine can give or that
    cannot end within MAX_MINUTES even at its matmul rate (the error names the script that was run)."""
    needed, flops = run_bill(args)
    lower = "lower --batch, --length, --d-model, --layers or --steps"
    problem = limits.memory_problem(needed, "this run", lower, " (the weights, Adam's state and one step's arrays)")
    problem = problem or limits.time_problem(flops, machine.matmul_rate("float32", n=1024, repeats=3), lower)
    if problem:
        sys.exit(f"{script}: error: {problem}")


# ---------------------------------------------------------------------------------------------------
# the run


def parse_args(
    argv: list[str] | None,
    add_more: Callable[[argparse.ArgumentParser], None] | None = None,
    description: str | None = None,
    prog: str | None = None,
) -> argparse.Namespace:
    """The copy task's flags, and those add_more(p) adds (the calling script's own), checked together."""
    p = argparse.ArgumentParser(
        prog=prog, description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="flash_attention and its blockwise backward (default); --no-fused: the reference attention()",
    )
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare every gradient of a tiny float64 model with finite differences first (default on)",
    )
    if add_more is not None:
        add_more(p)
    outputs.add_plot_arguments(p, "the attention before and after")
    p.add_argument("--json", metavar="PATH", help="write the table's figures, the machine and the code version to PATH")
    add_seed_and_format(p, "data and weights")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the flags must satisfy together (each flag alone is checked by its argparse type)."""
    if args.vocab > len(SYMBOLS):
        p.error(f"--vocab must be at most {len(SYMBOLS)} (one character per token in the heat map); got {args.vocab}")
    if args.length < 2:
        p.error(f"--length must be at least 2 (the second copy needs a token to predict); got {args.length}")
    if args.length > 256 or args.batch > 4096 or args.d_model > 1024 or args.layers > 8:
        p.error(
            "sizes this large would not finish on a CPU: keep --length <= 256, --batch <= 4096, "
            "--d-model <= 1024, --layers <= 8"
        )
    kv_heads = args.kv_heads or args.heads
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error(f"--d-model ({args.d_model}) must split into --heads ({args.heads}) heads of an even size (RoPE)")
    if args.heads % kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})")
    outputs.check_output(p, "--json", args.json)
    outputs.check_plot(p, args.plot, args.overwrite)


class NonFiniteLoss(ArithmeticError):
    """The loss or a gradient became inf or NaN: training cannot recover,
    and what came after would mean nothing."""

    def __init__(self, step: int, loss: float, lr: float):
        what = f"the loss became {loss}" if not np.isfinite(loss) else f"the gradients overflowed (loss {loss:.3g})"
        super().__init__(
            f"{what} at step {step}: training cannot go on from there. Lower --lr (now {lr:g}; Adam moves each "
            "weight by about lr a step, and the default is 0.005)"
        )


def train(
    args: argparse.Namespace, progress: bool = True, rows: list[dict[str, Any]] | None = None
) -> tuple[TinyModel, list[dict[str, Any]], dict[str, Any]]:
    """Train from args; return the model, the table's rows and the held-out sequence's weights. The rows go
    into `rows` as they are measured, so that a caller keeps them when Ctrl-C or a NonFiniteLoss stops it."""
    rng = np.random.default_rng(args.seed)
    model = TinyModel(args.vocab, args.d_model, args.heads, args.kv_heads or args.heads, args.layers, rng, np.float32)
    held_out = make_batch(np.random.default_rng(args.seed + 1), HELD_OUT, args.length, args.vocab)  # never trained on
    shown = held_out[0]
    before = [model.attention_weights(shown, i) for i in range(args.layers)]
    optimiser = Adam(model.parameters(), args.lr)
    rows = [] if rows is None else rows
    train_loss: float | None = None
    start = time.perf_counter()
    evaluated = set(table_steps(args))
    for step in range(args.steps + 1):
        if step in evaluated:
            loss, accuracy = model.evaluate(held_out, args.length)
            if not np.isfinite(loss):
                raise NonFiniteLoss(step, loss, args.lr)
            rows.append(dict(step=step, train_loss=train_loss, held_out_loss=loss, held_out_accuracy=accuracy))
            # train_loss: the mean of the last step's batch (none yet at step 0)
        if step == args.steps:
            break
        batch = make_batch(rng, args.batch, args.length, args.vocab)
        # NumPy's overflow warnings: the check below says it once, with a cure
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
            loss, grads = model.loss_and_grads(batch, args.length, args.fused)
            if not (np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())):
                raise NonFiniteLoss(step + 1, loss, args.lr)
            optimiser.step(grads)
        train_loss = loss
        if progress and (step + 1) % 10 == 0:
            print(
                f"\r  step {step + 1}/{args.steps}  loss {loss:.3f}  {time.perf_counter() - start:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    after = [model.attention_weights(shown, i) for i in range(args.layers)]
    return model, rows, dict(tokens=shown, before=before, after=after)


def table_steps(args: argparse.Namespace) -> list[int]:
    """The steps at which the table has a row: 0, every --eval-every, and the last."""
    return sorted({*range(0, args.steps, args.eval_every), args.steps})


def print_rows(rows: list[dict[str, Any]], fmt: str) -> None:
    body = [
        [
            r["step"],
            "-" if r["train_loss"] is None else f"{r['train_loss']:.3f}",
            f"{r['held_out_loss']:.3f}",
            f"{r['held_out_accuracy']:.1%}",
        ]
        for r in rows
    ]
    print(text_table(body, ["step", "train loss", "held-out loss", "held-out accuracy"], fmt=fmt))


def print_attention(args: argparse.Namespace, shown: dict[str, Any], accuracy: float) -> None:
    """The last layer's best head (by its weight on the token to copy) before and after, and the plot."""
    layer = args.layers - 1
    before, after = shown["before"][layer], shown["after"][layer]
    head = int(np.argmax([induction_weight(w, args.length) for w in after]))  # the head that learned it best
    tokens = shown["tokens"]
    print(
        f"\nattention of layer {layer}, head {head} on one held-out sequence, before and after training\n"
        f"(row = query, '{SHADES}' = weight 0 .. 1; the token to copy sits {args.length - 1} back):"
    )
    for name, weights in (("before", before[head]), ("after", after[head])):
        print(
            f"\n{name}: mean weight on the token {args.length - 1} back = {induction_weight(weights, args.length):.2f}"
        )
        print(heat_map(weights, tokens, SYMBOLS))
    if args.plot:
        title = f"layer {layer}, head {head}: {args.length} random tokens, repeated; held-out accuracy {accuracy:.0%}"
        plot(before[head], after[head], tokens, args.length, args.plot, title)
        print(f"\nplot written to {args.plot}")


def print_intro(args: argparse.Namespace) -> None:
    print(
        f"task: {args.length} random tokens of {args.vocab}, then the same {args.length} again; predict the "
        f"second copy's next token (chance {1 / args.vocab:.0%})"
    )
    print(
        f"model: embeddings {args.vocab} x {args.d_model}, {args.layers} x MultiHeadAttention({args.d_model}, "
        f"{args.heads} heads, {args.kv_heads or args.heads} kv heads, RoPE, causal) + residual,\n"
        f"  output {args.d_model} x {args.vocab}; "
        f"{'flash_attention + flash_attention_backward' if args.fused else 'attention + attention_backward'}"
    )


def run(args: argparse.Namespace) -> int:
    """train.py --task copy: the gradient check, the training, the table and the heat maps; the exit code."""
    check_run(args, "train.py")
    info, lines = machine.header()
    print(lines)
    print_intro(args)
    if args.check:
        worst = gradient_check(args.layers, args.fused, args.seed)
        ok = worst < 1e-7
        print(
            f"gradient check (float64, every weight of a tiny model, central differences): max |error| = "
            f"{worst:.1e} {'ok' if ok else 'FAILED (> 1e-7)'}"
        )
        if not ok:
            return 1
    rows: list[dict[str, Any]] = []
    start, stop = time.perf_counter(), None
    try:
        _, _, shown = train(args, rows=rows)
    except (KeyboardInterrupt, NonFiniteLoss) as err:
        stop = err
    seconds = time.perf_counter() - start
    busy = machine.busy_reasons()
    print(
        f"\nAdam, lr {args.lr}, batch {args.batch}, {args.steps} steps in {seconds:.1f} s; held out: {HELD_OUT} "
        f"sequences" + (f"\n(* timed on a busy machine: {'; '.join(busy)})" if busy else "")
    )
    print_rows(rows, args.format)
    if stop is None:
        print_attention(args, shown, rows[-1]["held_out_accuracy"])
    if args.json:
        figures = {"machine": info, "args": vars(args), "seconds": seconds, "busy": busy, "rows": rows}
        figures["stopped"] = None if stop is None else str(stop) or "Ctrl-C"
        outputs.write_json(args.json, figures, isinstance(stop, KeyboardInterrupt))
    if isinstance(stop, NonFiniteLoss):
        print(f"train.py: stopped: {stop}", file=sys.stderr)
        return 1
    return interrupts.interrupted(len(rows), len(table_steps(args)), "table rows") if stop else 0
