"""How fast the GPT trains and generates: our training step beside torch's eager step of the same model,
and generation with the KV cache beside recomputation.

    python scripts/train_speed.py                             # seconds: the tiny preset, 256 tokens generated
    python scripts/train_speed.py --torch --presets tiny part3 --tokens 1024   # minutes: both, beside torch
    python scripts/train_speed.py --equal-time 10             # the validation loss after 10 s of each
    python scripts/train_speed.py --row-blocks                # the elementwise layers by block size
    python scripts/train_speed.py --nanogpt ~/nanoGPT --data input.txt  # nanoGPT's CPU recipe beside ours

1) A training step of each preset (train.py's: loss_and_grads, clip_grad_norm to 1.0, AdamW.step) on a
   random batch of the preset's size and vocabulary (tiny: 65, Tiny Shakespeare's characters; part3: 4,096,
   the series' tokenizer): the median over --rounds turns of --repeats steps, each turn after two untimed
   steps. With --torch, the same model in torch, eager (nn.Embedding, nn.LayerNorm, nn.Linear, RoPE on
   interleaved pairs, F.scaled_dot_product_attention, the head tied to the embedding, F.cross_entropy,
   backward, clip_grad_norm_, torch.optim.AdamW with decay on the matrices only), from the same weights, on
   the same batch, with as many threads as our BLAS: the first two steps' losses must agree (float32), and
   then the two take turns, so that a machine whose speed drifts during the run (another tenant's load)
   slows both alike. Then each step split in two: its dense products alone (every weight matrix's x W, dy Wᵀ
   and xᵀ dy, and the tied head's, at the step's shapes: step_products.py), ours and torch's in turns, and the
   rest of the step (its time less its products'), where the two differ in everything but the BLAS.
2) Generation of --tokens tokens after a one-token prompt, greedy, with the cache and by recomputing the
   whole sequence at every step (past the context, the last `context` tokens): tokens per second of each,
   and the check that both give the same tokens.
Both run under train.py's malloc setting (os_tweaks.keep_freed_memory: on glibc, freed arrays' memory is kept
for the next ones instead of faulting it in again every step), which holds for the whole process, torch's
steps as well as ours; the malloc line says whether it took. They run under train.py's OpenBLAS setting too
(os_tweaks.py: its idle threads sleep soon instead of spinning, so that they leave the cores to our
attention's workers; torch's own threads are not OpenBLAS's), named on the OpenBLAS line. Every claim is
checked; the exit code is 1 (and the failed check is named) if one fails.

--equal-time SECONDS (needs torch) does instead: our model and its torch twin, from the same weights, train
on the same batches of this project's own pages (character tokens), each for SECONDS of wall time, in
--rounds turns of SECONDS / rounds, taking turns (AdamW at the preset's learning rate, no schedule: the
number of steps is not known ahead), and then both are validated on the same windows of the text's last
tenth: both losses, and ours relative to torch's. The faster step takes more steps in the same time, and
that is what the difference shows.

--row-blocks does instead: layer_norm, gelu and their backwards (random float32 rows, as many as a preset's
batch x context) in blocks of rows of 2^13 .. 2^20 elements (layers.py says why), taking turns: ms per call,
and a step's worth (2L + 1 norms, L GELUs); the size the layers take here (tune.row_block()) is marked.

--nanogpt PATH --data PATH does instead: nanoGPT's own CPU recipe (a copy of the checkout at PATH, on the
text) and scripts/train.py --preset tiny, --steps each, both wall times and both models' validation losses on
the same windows (nanogpt_recipe.py says how).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import os_tweaks

# train.py's settings, made as it makes them, before NumPy loads (os_tweaks.py says why)
if __name__ == "__main__":
    os_tweaks.speed_up()
# ruff: noqa: E402  (the imports below come after that setting on purpose)
import interrupts
import limits
import machine
import nanogpt_recipe
import numpy as np
import outputs
import row_blocks
import step_products
import text_data
import torch_gpt
import torch_import
import train_flags

from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.measure import alternating_medians_ms
from tinyattn_np.optim import AdamW, clip_grad_norm
from tinyattn_np.report import (
    Checklist,
    add_seed_and_format,
    add_wide_argument,
    positive,
    table_width,
)
from tinyattn_np.sampling import generate
from tinyattn_np.trainbill import training_memory

LOSS_RTOL = 1e-4  # float32 sums in two orders over a forward and a backward
check = Checklist()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--presets",
        nargs="+",
        choices=sorted(train_flags.PRESETS),
        default=["tiny"],
        help="the models to time (default tiny, a run of seconds; part3's step and generation take minutes)",
    )
    p.add_argument("--vocab", type=positive(int), help="vocabulary size (default: the preset's, 65 or 4,096)")
    p.add_argument("--batch", type=positive(int), help="sequences per step (default: each preset's)")
    p.add_argument("--repeats", type=positive(int), default=5, help="timed steps (or layer calls) a turn (default 5)")
    p.add_argument(
        "--rounds",
        type=positive(int),
        default=3,
        help="turns of each model (--row-blocks: each size), taking turns (default 3)",
    )
    p.add_argument("--tokens", type=positive(int), default=256, help="tokens to generate (default 256)")
    p.add_argument("--torch", action="store_true", help="time torch's eager training step beside ours")
    p.add_argument(
        "--equal-time",
        type=positive(float, 3600.0),
        metavar="SECONDS",
        help="train ours and torch's SECONDS each; compare validation losses (needs torch)",
    )
    p.add_argument("--row-blocks", action="store_true", help="time the elementwise layers by block size instead")
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    nanogpt_recipe.add_arguments(p)
    add_wide_argument(p)
    add_seed_and_format(p, "the weights and the batch")
    args = p.parse_args(argv)
    nanogpt_recipe.check_arguments(p, args)
    steps = args.repeats * args.rounds
    if (args.vocab or 0) > 1_000_000 or args.tokens > 100_000 or steps > 10_000 or (args.batch or 0) > 4096:
        p.error("keep --vocab <= 1,000,000, --tokens <= 100,000, --repeats x --rounds <= 10,000 and --batch <= 4,096")
    outputs.check_output(p, "--json", args.json)
    if args.row_blocks and (args.torch or args.equal_time is not None):
        p.error("--row-blocks times our layers alone: leave out --torch and --equal-time")
    for name in args.presets:
        bill = training_memory(config_of(name, args), batch_of(name, args))
        problem = limits.memory_problem(bill.peak, f"a training step of {name}", "lower --batch or --vocab")
        if problem:
            p.error(problem)
    return args


def config_of(name: str, args: argparse.Namespace) -> GPTConfig:
    config = train_flags.PRESETS[name].config
    return replace(config, vocab=args.vocab or config.vocab)


def batch_of(name: str, args: argparse.Namespace) -> int:
    return int(args.batch or train_flags.PRESETS[name].batch)


# ---------------------------------------------------------------------------------------------------
# the same model in torch (torch_gpt.py), from our weights


def twin(torch: Any, model: GPT) -> Any:
    """The torch module of model's architecture (torch_gpt.torch_model), holding model's weights."""
    module = torch_gpt.torch_model(torch, model.config)
    copy_weights(torch, module, model)
    return module


def copy_weights(torch: Any, module: Any, model: GPT) -> None:
    """Our parameters into the torch module, under its names; every one of its parameters is set."""
    theirs = dict(module.named_parameters())
    names = {name: torch_gpt.torch_name(name) for name in model.params}
    check(
        sorted(theirs) == sorted(n for n, _ in names.values()),
        "the torch model has our parameters, no others",
    )
    with torch.no_grad():
        for name, (target, transposed) in names.items():
            value = model.params[name]
            theirs[target].copy_(torch.from_numpy(np.ascontiguousarray(value.T if transposed else value)))


# ---------------------------------------------------------------------------------------------------
# 1) the training step, 2) generation


def our_step(model: GPT, optimizer: AdamW, x: np.ndarray, y: np.ndarray, lr: float) -> float:
    """train.py's step: the loss and every gradient, clipping to 1.0, AdamW."""
    loss, grads = model.loss_and_grads(x, y)
    clip_grad_norm(grads, 1.0)
    optimizer.step(model.params, grads, lr=lr)
    return loss


def time_training(name: str, args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """One preset's row: our step's median time, and torch's with --torch (after two steps of each from the
    same weights on the same batch: the same two losses, the second after clipping and AdamW)."""
    config, batch, preset = config_of(name, args), batch_of(name, args), train_flags.PRESETS[name]
    beside = " and torch's, in turns" if torch is not None else ""
    outputs.progress(f"{name}: a training step{beside}, {args.rounds} turns of {args.repeats} steps after 2 untimed")
    rng = np.random.default_rng(args.seed)
    x, y = rng.integers(0, config.vocab, (2, batch, config.context))  # (B, T) each
    model = GPT(config, rng=args.seed)
    module = twin(torch, model) if torch is not None else None  # from the weights before any step
    optimizer = AdamW(model.params, lr=preset.lr, betas=(0.9, preset.beta2), weight_decay=0.1)
    ours = [our_step(model, optimizer, x, y, preset.lr) for _ in range(2)]
    row = {"preset": name, "parameters": model.num_parameters, "batch": batch, "context": config.context}
    steps = [lambda: our_step(model, optimizer, x, y, preset.lr)]
    if module is not None:
        torch_optimizer = torch_gpt.torch_adamw(torch, module, preset)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        gold = [torch_gpt.torch_step(torch, module, torch_optimizer, tx, ty) for _ in range(2)]
        for step, (mine, theirs) in enumerate(zip(ours, gold, strict=True), start=1):
            check(
                abs(mine - theirs) <= LOSS_RTOL * abs(theirs),
                f"{name}: step {step}'s loss equals torch's ({mine:.6f} and {theirs:.6f})",
            )
        steps.append(lambda: torch_gpt.torch_step(torch, module, torch_optimizer, tx, ty))
    times = alternating_medians_ms(steps, args.repeats, args.rounds, idle=machine.SETTLE_SECONDS)
    row["ours_ms"] = times[0]
    if module is not None:
        row["torch_ms"] = times[1]
        row["ours_products_ms"], row["torch_products_ms"] = step_products.time_products(
            torch, model, batch, args.repeats, args.rounds, machine.SETTLE_SECONDS
        )
    row["busy"] = machine.busy_reasons()
    return row


def time_generation(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One preset's generation row: --tokens greedy tokens with the cache and without, timed once each."""
    outputs.progress(f"{name}: generation of {args.tokens:,} tokens with the KV cache, then without one")
    model = GPT(config_of(name, args), rng=args.seed)
    prompt = np.zeros(1, dtype=np.int64)  # (1,): one token
    row: dict[str, Any] = {"preset": name, "tokens": args.tokens}
    drawn = {}
    for use_cache in (True, False):
        time.sleep(machine.SETTLE_SECONDS)
        started = time.perf_counter()
        drawn[use_cache] = generate(model, prompt, args.tokens, temperature=0.0, use_cache=use_cache)
        row["cache_s" if use_cache else "no_cache_s"] = time.perf_counter() - started
    row["busy"] = machine.busy_reasons()
    check(
        np.array_equal(drawn[True], drawn[False]),
        f"{name}: the cache and recomputation give the same tokens",
    )
    return row


# ---------------------------------------------------------------------------------------------------
# 3) --equal-time: the validation loss after the same wall time


def train_in_turns(seconds: float, steps: list[Any], rounds: int) -> list[int]:
    """Each of `steps` (step(0), step(1), ...) for `seconds` of wall time in all, in `rounds` turns of
    seconds / rounds, the models taking turns, each turn after the idle of machine.settled_median_ms (the
    other library's threads asleep first); the number of steps each took."""
    taken = [0] * len(steps)
    for _ in range(rounds):
        for n, step in enumerate(steps):
            time.sleep(machine.SETTLE_SECONDS)
            started = time.perf_counter()
            while time.perf_counter() - started < seconds / rounds:
                step(taken[n])
                taken[n] += 1
    return taken


def validation_loss(loss_of: Any, batches: list[tuple[np.ndarray, ...]]) -> float:
    """The mean loss over the validation windows (loss_of(x, y): the mean over one batch's rows)."""
    return sum(loss_of(x, y) * len(x) for x, y in batches) / sum(len(x) for x, _ in batches)


def equal_time(name: str, args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """One preset's row of --equal-time: steps and validation loss of each after args.equal_time seconds."""
    outputs.progress(f"{name}: ours and torch's train {args.equal_time:g} s each, in {args.rounds} turns")
    text, source = text_data.load_text(None)
    tokenizer = text_data.make_tokenizer("char", text)
    config, batch, preset = config_of(name, args), batch_of(name, args), train_flags.PRESETS[name]
    config = replace(config, vocab=tokenizer.vocab_size)
    tokens = tokenizer.encode(text).astype(np.int64)  # torch's cross_entropy takes int64 targets
    train, val = text_data.split(tokens, config.context, 0.1, source)
    windows = text_data.fixed_batches(val, 64, batch, config.context)  # the same validation windows for both
    model = GPT(config, rng=args.seed)
    module = twin(torch, model)  # from the weights before any step
    optimizer = AdamW(model.params, lr=preset.lr, betas=(0.9, preset.beta2), weight_decay=0.1)
    torch_optimizer = torch_gpt.torch_adamw(torch, module, preset)
    rng, drawn = np.random.default_rng(args.seed), []

    def batch_number(i: int) -> tuple[np.ndarray, ...]:  # the i-th batch, the same for both
        while len(drawn) <= i:
            drawn.append(text_data.random_batch(rng, train, batch, config.context))  # (B, T) each
        return drawn[i]

    def torch_loss(x: np.ndarray, y: np.ndarray) -> float:
        with torch.no_grad():
            return float(module(torch.from_numpy(x), torch.from_numpy(y)).item())

    start = validation_loss(model.loss, windows), validation_loss(torch_loss, windows)
    check(
        abs(start[0] - start[1]) <= LOSS_RTOL * start[1],
        f"{name}: both start from the same validation loss ({start[0]:.6f} and {start[1]:.6f})",
    )
    # one untimed step of each on a copy, so that neither library's first-call costs land in the budget
    our_step(GPT(config, model.params), AdamW(model.params, lr=preset.lr), *batch_number(0), preset.lr)
    spare = copy.deepcopy(module)
    torch_gpt.torch_step(
        torch, spare, torch_gpt.torch_adamw(torch, spare, preset), *map(torch.from_numpy, batch_number(0))
    )
    ours, theirs = train_in_turns(
        args.equal_time,
        [
            lambda i: our_step(model, optimizer, *batch_number(i), preset.lr),
            lambda i: torch_gpt.torch_step(torch, module, torch_optimizer, *map(torch.from_numpy, batch_number(i))),
        ],
        args.rounds,
    )
    row = {"preset": name, "seconds": args.equal_time, "start_loss": start[0], "ours_steps": ours}
    row["torch_steps"], row["busy"] = theirs, machine.busy_reasons()
    row["ours_loss"], row["torch_loss"] = (
        validation_loss(model.loss, windows),
        validation_loss(torch_loss, windows),
    )
    return row


def print_equal_time(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n3) validation loss after {args.equal_time:g} s of training each, in {args.rounds} turns each, ours and "
        "torch's\n   alternating, from the same weights on the same batches (this project's pages, character "
        "tokens;\n   AdamW at the preset's learning rate)"
    )
    headers = ["preset", "start loss", "ours steps", "torch steps", "ours loss", "torch loss"]
    headers += ["ours / torch - 1"]
    body = [
        [
            r["preset"],
            f"{r['start_loss']:.4f}",
            f"{r['ours_steps']:,}",
            f"{r['torch_steps']:,}",
            f"{r['ours_loss']:.4f}",
            f"{r['torch_loss']:.4f}",
            f"{r['ours_loss'] / r['torch_loss'] - 1:+.2%}",
        ]
        for r in rows
    ]
    print(machine.marked_table(body, rows, headers, args.format, preset_label, width=table_width(args)))


def preset_label(row: dict[str, Any]) -> str:
    return str(row["preset"])


def print_training(rows: list[dict[str, Any]], args: argparse.Namespace, threads: str) -> None:
    turns = f"{args.rounds} turns of {args.repeats} steps" + (", ours and torch's alternating" if args.torch else "")
    print(f"\n1) a training step (forward, backward, clipping, AdamW), float32, the median of {turns}\n   {threads}")
    headers = ["preset", "parameters", "batch x context", "ours ms", "tokens/s"]
    if args.torch:
        headers += ["torch ms", "ours / torch"]
    body = []
    for r in rows:
        cells = [
            r["preset"],
            f"{r['parameters']:,}",
            f"{r['batch']} x {r['context']}",
            f"{r['ours_ms']:,.1f}",
            f"{r['batch'] * r['context'] / r['ours_ms'] * 1e3:,.0f}",
        ]
        if args.torch:
            cells += [f"{r['torch_ms']:,.1f}", f"{r['ours_ms'] / r['torch_ms']:.2f}"]
        body.append(cells)
    print(machine.marked_table(body, rows, headers, args.format, preset_label, width=table_width(args)))
    if args.torch:
        print_products(rows, args)


def print_products(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each step split in two: its dense products alone (step_products.py), ours and torch's timed in turns,
    and the rest of the step (the step's time less its products')."""
    print(
        "   the step's dense products alone (every weight matrix's x W, dy Wᵀ and xᵀ dy, the tied head's three; the\n"
        "   attention's own left out), ours and torch's in turns, and the rest of each step:"
    )
    headers = [
        "preset",
        "products: ours ms",
        "torch ms",
        "ours / torch",
        "the rest: ours ms",
        "torch ms",
        "ours / torch",
    ]
    body = []
    for r in rows:
        ours, theirs = r["ours_products_ms"], r["torch_products_ms"]
        rest_ours, rest_torch = r["ours_ms"] - ours, r["torch_ms"] - theirs
        body.append(
            [
                r["preset"],
                f"{ours:,.1f}",
                f"{theirs:,.1f}",
                f"{ours / theirs:.2f}",
                f"{rest_ours:,.1f}",
                f"{rest_torch:,.1f}",
                f"{rest_ours / rest_torch:.2f}",
            ]
        )
    print(machine.marked_table(body, rows, headers, args.format, preset_label, width=table_width(args)))


def print_generation(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n2) generation of {args.tokens:,} tokens after a one-token prompt, greedy, batch 1")
    body = [
        [
            r["preset"],
            f"{r['tokens'] / r['no_cache_s']:,.1f}",
            f"{r['tokens'] / r['cache_s']:,.1f}",
            f"{r['no_cache_s'] / r['cache_s']:.1f}x",
        ]
        for r in rows
    ]
    headers = ["preset", "no cache, tokens/s", "KV cache, tokens/s", "cache speed-up"]
    print(machine.marked_table(body, rows, headers, args.format, preset_label, width=table_width(args)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nanogpt is not None:
        figures, stopped = nanogpt_recipe.main_recipe(args)
        return finish(args, figures, stopped, int(not stopped), 1)
    if args.equal_time is not None:
        return main_equal_time(args)
    if args.row_blocks:
        return main_row_blocks(args)
    torch = torch_import.load_torch(flag="--torch")[0] if args.torch else None
    info, lines = machine.header(torch.__version__ if torch else None, torch.get_num_threads() if torch else None)
    print(f"{lines}\n{malloc_line(torch is not None)}\n{os_tweaks.describe()}")
    threads = "threads: our BLAS's, as the BLAS line says" + (f"; torch's {torch.get_num_threads()}" if torch else "")
    steps: list[dict[str, Any]] = []
    generations: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(args.presets, lambda name: time_training(name, args, torch), steps)
    if steps:
        print_training(steps, args, threads)
    if not stopped:
        stopped = interrupts.measure_each(args.presets, lambda name: time_generation(name, args), generations)
    if generations:
        print_generation(generations, args)
    figures = {"machine": info, "args": vars(args), "training": steps, "generation": generations}
    return finish(args, figures, stopped, len(steps) + len(generations), 2 * len(args.presets))


def main_equal_time(args: argparse.Namespace) -> int:
    """--equal-time: the third table only."""
    torch = torch_import.load_torch(flag="--equal-time")[0]
    info, lines = machine.header(torch.__version__, torch.get_num_threads())
    print(f"{lines}\n{malloc_line(with_torch=True)}\n{os_tweaks.describe()}")
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(args.presets, lambda name: equal_time(name, args, torch), rows)
    if rows:
        print_equal_time(rows, args)
    figures = {"machine": info, "args": vars(args), "equal_time": rows}
    return finish(args, figures, stopped, len(rows), len(args.presets))


# ---------------------------------------------------------------------------------------------------
# --row-blocks: the elementwise layers by block size


def main_row_blocks(args: argparse.Namespace) -> int:
    """--row-blocks: the fourth table only."""
    info, lines = machine.header()
    print(f"{lines}\n{malloc_line(with_torch=False)}")
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(
        args.presets,
        lambda name: row_blocks.time_presets(name, config_of(name, args), batch_of(name, args), args),
        rows,
    )
    if rows:
        row_blocks.print_rows(rows, args)
    figures = {"machine": info, "args": vars(args), "row_blocks": rows}
    return finish(args, figures, stopped, len(rows), len(args.presets))


def malloc_line(with_torch: bool) -> str:
    """Whether train.py's malloc setting (os_tweaks.keep_freed_memory, made at the top as a program) is in
    force; it holds for the whole process, torch's steps as well as ours."""
    if not os_tweaks.freed_memory_kept:
        return "malloc: the C library's own settings"
    return "malloc: freed memory kept for reuse, as train.py sets it (glibc's mallopt)" + (
        "; for torch's steps too" if with_torch else ""
    )


def finish(args: argparse.Namespace, figures: dict[str, Any], stopped: bool, done: int, total: int) -> int:
    """The last lines of either mode: --json written, Ctrl-C's line; the exit code. (A busy machine is said
    under each table, its rows marked.)"""
    figures["busy"] = machine.busy_reasons()
    if args.json:
        outputs.write_json(args.json, figures, stopped)
    if stopped:
        return interrupts.interrupted(done, total)
    return check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
