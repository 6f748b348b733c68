"""What train.py prints: the run before its first step (the data, the model, the training settings, the memory
of a step), a row of the table at every validation, a progress bar on stderr between them, and at the end the
steps' speed, a sample of the model's text, the checkpoint, the loss plot and --json."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import interrupts
import machine
import numpy as np
import outputs
import text_data
from checkpoint import Row, Run
from train_flags import MODEL_FLAGS, PRESETS

from tinyattn_np import format_bytes
from tinyattn_np.gpt import parameter_count
from tinyattn_np.optim import warmup_cosine_lr
from tinyattn_np.report import fold_lines
from tinyattn_np.sampling import generate
from tinyattn_np.trainbill import training_memory

ROW_HEADER = f"{'step':>7}  {'train loss':>10}  {'val loss':>8}  {'lr':>9}  {'tokens/s':>9}  {'time':>8}"


def print_start(run: Run, args: argparse.Namespace, processes: int) -> None:
    """The lines before the table: the data, the model, the training settings, the memory of a step."""
    c, s, data = run.model.config, run.settings, run.data
    print(
        f"data: {data.source}: {len(data.train) + len(data.val):,} tokens ({data.tokenizer.describe()['kind']} "
        f"tokenizer, vocabulary {c.vocab:,});\n  {len(data.train):,} to train on, {len(data.val):,} to validate on"
    )
    preset = PRESETS[run.preset].config
    changed = ", ".join(name for name in MODEL_FLAGS if getattr(c, name) != getattr(preset, name))
    changed = f"; not the preset's: {changed}" if changed else ""  # the model flags' doing, new or resumed
    vocabulary = ""  # the preset's own count is at its vocabulary (part3's 5,781,504 at 4,096), not this one's
    if c.vocab != preset.vocab:
        at_preset = parameter_count(replace(c, vocab=preset.vocab))
        vocabulary = f" at a vocabulary of {c.vocab:,} ({at_preset:,} at the preset's {preset.vocab:,})"
    print(
        f"model: GPT ({run.preset}), {c.layers} layer{'s' * (c.layers != 1)}, {c.heads} head{'s' * (c.heads != 1)}, "
        f"width {c.width}, context {c.context}, {c.mlp} MLP of {c.hidden}, {c.norm}{' with biases' * c.bias},\n"
        f"  tied head: {run.model.num_parameters:,} parameters ({c.dtype}){vocabulary}{changed}"
    )
    split = f" split over {processes} processes" if processes > 1 else ""
    slices = ""
    if s.accumulate > 1:
        rows, each = s.batch // processes // s.accumulate, " a process" if processes > 1 else ""  # in a slice
        slices = f",\n  in {s.accumulate} slices of {rows} sequence{'s' * (rows != 1)}{each} (gradient accumulation)"
    print(
        f"training: AdamW (lr {s.lr:g} -> {s.min_lr:g}, warm-up {s.warmup} steps, cosine to step {s.steps}, "
        f"β2 {s.beta2:g}, weight decay {s.weight_decay:g}),\n  clip {s.clip:g}, batch {s.batch} x {c.context} "
        f"tokens{split}{slices}"
    )
    bill = training_memory(c, s.batch // processes, accumulate=s.accumulate)
    names = ("weights", "moments", "activations") + (("accumulated",) if bill.accumulated else ())
    parts = ", ".join(f"{name} {format_bytes(getattr(bill, name))}" for name in names)
    print(f"memory of a step: {format_bytes(bill.peak)} at its peak\n  ({parts}; trainbill.training_memory)")
    if args.data_parallel and processes == 1:
        print("ran 1 process, so nothing was split; for 2: mpiexec -n 2 python scripts/train.py --data-parallel")
    if run.step:
        print(f"resumed from {args.out} at step {run.step}")
    elif args.init_from:
        print(f"started from the weights of the checkpoint in {args.init_from} (--init-from)")


class Log:
    """The table and the progress bar as the loop goes (printed where show: rank 0), and this session's step
    times, which the rows' speeds and the last line are measured from."""

    def __init__(self, run: Run, show: bool):
        self.show = show
        self.step_seconds: list[float] = []  # this session's steps
        self.first, self.shown, self.bar = run.step, 0.0, False

    def row(self, run: Run, val_loss: float) -> Row:
        """A row of the table: the training loss (the mean of the steps since the last row), the validation
        loss, the last step's learning rate and the speed of those steps; printed where show."""
        since = run.rows[-1].step if run.rows else 0
        losses = [loss for step, loss in run.history if step > since]
        s, T = run.settings, run.model.config.context
        steps = self.step_seconds[-(run.step - since) :] if run.step > since and self.step_seconds else []
        lr = (
            warmup_cosine_lr(run.step - 1, lr=s.lr, warmup=s.warmup, total=s.steps, min_lr=s.min_lr)
            if run.step
            else None
        )
        row = Row(
            step=run.step,
            train_loss=float(np.mean(losses)) if losses else None,
            val_loss=val_loss,
            lr=lr,  # the last step's
            tokens_per_s=len(steps) * s.batch * T / sum(steps) if steps else None,
            seconds=run.seconds,
        )
        if self.show:
            self.end_bar()
            train = "-" if row.train_loss is None else f"{row.train_loss:.4f}"
            speed = "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}"
            lr_text = "-" if row.lr is None else f"{row.lr:.2e}"
            cells = f"{run.step:>7}  {train:>10}  {val_loss:>8.4f}  {lr_text:>9}  {speed:>9}  {row.seconds:>7.1f}s"
            print(cells, flush=True)
        return row

    def step(self, run: Run, loss: float, seconds: float) -> None:
        """After a step: its time kept (and added to the run's); where show, after two steps how long the run
        takes (if over a minute), and the progress bar, every quarter of a second and at the last step."""
        self.step_seconds.append(seconds)
        run.seconds += seconds
        if not self.show:
            return
        if run.step - self.first == 2:
            self.say_how_long(run)
        if time.perf_counter() - self.shown > 0.25 or run.step == run.settings.steps:
            self.shown = time.perf_counter()
            self.progress_bar(run, loss)

    def progress_bar(self, run: Run, loss: float) -> None:
        """One line on stderr, rewritten in place: the steps done, the loss, tokens per second, time left."""
        recent = self.step_seconds[-20:]
        per_step = sum(recent) / len(recent)
        total, width = run.settings.steps, 24
        filled = width * run.step // total
        left = (total - run.step) * per_step
        speed = run.settings.batch * run.model.config.context / per_step
        line = (
            f"step {run.step}/{total} [{'#' * filled}{'.' * (width - filled)}] loss {loss:.4f}  "
            f"{speed:,.0f} tokens/s  {clock(left)} left"
        )
        print(f"\r{line}", end="", file=sys.stderr, flush=True)
        self.bar = True

    def end_bar(self) -> None:
        """End the progress bar's line, so that what is printed next starts on a line of its own."""
        if self.bar:
            outputs.progress("")
            self.bar = False

    def say_how_long(self, run: Run) -> None:
        """After two steps, where the run will take more than a minute: how long,
        from the second step's time."""
        steps = run.settings.steps - run.step
        left = steps * self.step_seconds[-1]
        if left > 60:
            self.end_bar()
            outputs.progress(
                f"about {self.step_seconds[-1]:.2f} s a step: the {steps:,} steps left take about {clock(left)} "
                "(Ctrl-C stops and keeps a checkpoint)"
            )


def clock(seconds: float) -> str:
    """3725.0 -> '1 h 02 min', 65.0 -> '1 min 05 s', 5.0 -> '5 s'."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def finish(
    run: Run, args: argparse.Namespace, log: Log, stop: BaseException | None, info: Any, scaling: str | None
) -> None:
    """Rank 0 after the loop: the steps' speed, the sample, the checkpoint, the plot, --json, and what stopped
    the run early (Ctrl-C, or a loss that is not finite)."""
    seconds = sum(log.step_seconds)
    tokens = len(log.step_seconds) * run.settings.batch * run.model.config.context
    busy = machine.busy_reasons()
    busy_text = f" (* timed on a busy machine: {'; '.join(busy)})" if busy else ""
    print(f"{len(log.step_seconds)} steps in {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s{busy_text}")
    if scaling:
        print(scaling)
    if stop is None and args.sample:
        text, prompt = sample(run, args.sample)
        print(
            f"\nsample ({args.sample} tokens after {prompt}, temperature 0.8, seed {args.seed}; lines over 120 "
            "characters folded):"
        )
        print(fold_lines(text))
    if args.out:
        print(f"checkpoint: {args.out} (step {run.saved_step}); python scripts/sample.py {args.out}")
    if args.plot and run.history:
        plot_losses(run, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        figures = {
            "machine": info,
            "args": vars(args),
            "settings": asdict(run.settings),
            "validation": run.data.validation,
            "seconds": seconds,
            "busy": busy,
            "rows": [asdict(row) for row in run.rows],
            "stopped": None if stop is None else str(stop) or "Ctrl-C",
        }
        outputs.write_json(args.json, figures, isinstance(stop, KeyboardInterrupt))
    if isinstance(stop, KeyboardInterrupt):
        interrupts.interrupted(run.step, run.settings.steps, "steps", stop)
    elif stop is not None:
        print(f"train.py: stopped: {stop}", file=sys.stderr)


def sample(run: Run, tokens: int) -> tuple[str, str]:
    """tokens new tokens after sample.py's default prompt, temperature 0.8, seed --seed:
    (the text, the prompt)."""
    prompt, what = text_data.default_prompt(run.data.tokenizer)
    text = run.data.tokenizer.decode(generate(run.model, prompt, tokens, temperature=0.8, rng=run.seed))
    return text, what


def plot_losses(run: Run, path: str) -> None:
    """The training loss of every step and the validation loss of every row, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*run.history, strict=True) if run.history else ((), ())
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="training loss (each step's batch)")
    ax.plot([r.step for r in run.rows], [r.val_loss for r in run.rows], "o-", label="validation loss")
    c = run.model.config
    title = f"{run.preset}: {c.layers} layers, width {c.width}, {run.model.num_parameters:,} parameters; "
    ax.set_title(title + run.data.source, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
