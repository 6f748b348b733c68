"""Train a tiny GPT on any text, in NumPy: every gradient by hand, AdamW, checkpoints that resume bit for bit.

    python scripts/train.py                                # the tiny preset on this project's own pages
    python scripts/train.py --data input.txt --steps 2000 --out run --plot run/loss.png
    python scripts/train.py --out run --resume             # go on from run's checkpoint, to --steps
    python scripts/sample.py run --prompt "ROMEO:"         # then generate from it
    python scripts/train.py --data other.txt --init-from run --out tuned  # run's model, fine-tuned on another text
    mpiexec -n 2 python scripts/train.py --data-parallel   # the batch split over 2 processes
    python scripts/train.py --task copy                    # a smaller task: attention learns to copy

The model is tinyattn_np.gpt.GPT (pre-norm blocks of RoPE attention and a GELU MLP, a tied head); --preset
tiny is nanoGPT's CPU model for Shakespeare (4 layers, 4 heads, width 128, context 64, batch 12), --preset
part3 a 6-layer model of width 256 and context 256; --layers, --heads, --width, --context, --mlp, --norm and
--bias change the preset's model, --positions learned gives it a learned position table in place of RoPE
(nanoGPT's model), and --layer-pattern LLLA makes it a hybrid: three gated delta layers (linear attention,
Qwen3-Next's Gated DeltaNet) to one of softmax attention. The vocabulary is the tokenizer's: the characters of
the text (--tokenizer char, the default), its UTF-8 bytes (byte), or a Hugging Face tokenizer.json. The text
is cut into a training part and the last --validation of it, which is never trained on. A step: a batch of
random windows, the loss and every gradient (GPT.loss_and_grads), clipping of the global norm to --clip, and
AdamW with a linear warm-up and a cosine decay (tinyattn_np.optim). --accumulate K runs the batch K equal
slices at a time, their gradients summed: the same step, with one slice's activations in memory.

With --out DIR, a checkpoint (checkpoint.py: the weights, AdamW's moments, the configuration, the data's
fingerprint and the random generators' states) is written at every validation, at the end, and on Ctrl-C or
SIGTERM (kill, a batch scheduler's time limit); --out is checked writable before the first step.
--resume continues it, to the same bits as a run that was never stopped (the flags given to the run that wrote
it hold unless given again: a step's settings, --eval-every, --eval-windows). A loss that is not finite (a
learning rate far too large) stops the run, keeps the last checkpoint as it was and says what to change.
Under mpiexec, --data-parallel gives each process an equal slice of every batch and averages the gradients
with one Allreduce: the same losses as one process with the whole batch, to float32 rounding. The processes
agree on the run before the first step (the settings, the text, the vocabulary, the weights), or all refuse.

This file is the loop, to read top to bottom; beside it, train_flags.py (the flags and the presets),
text_data.py (the text and its batches), checkpoint.py (the run's state on disk), data_parallel.py (the
processes) and train_log.py (what is printed).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import os_tweaks

if __name__ == "__main__":  # a program's settings, made before NumPy loads (os_tweaks.py says why)
    os_tweaks.speed_up()
# ruff: noqa: E402  (the imports below come after that setting on purpose)
import checkpoint
import copy_task
import interrupts
import machine
import numpy as np
import text_data
import train_flags
import train_log
from checkpoint import Run
from data_parallel import START_ERRORS, Processes, scaling
from train_flags import PRESETS, RunError

from tinyattn_np import AttentionMemoryError
from tinyattn_np.gpt import GPT
from tinyattn_np.mpi_job import StopTogether
from tinyattn_np.optim import AdamW, accumulated_grads, clip_grad_norm, warmup_cosine_lr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (train_flags.py holds them, this docstring is their --help's text)."""
    return train_flags.parse_args(argv, __doc__ or "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.task == "copy":
        return copy_task.run(args)
    processes = Processes.of(args)  # with --data-parallel, this process among mpiexec's; else this one alone
    try:  # every process starts the same run, or none starts: a process's error, or a difference, said by rank 0
        run = processes.start_together(partial(start, args, processes))
    except START_ERRORS as err:
        if processes.rank == 0:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    info = None
    if processes.rank == 0:
        info, lines = machine.header()
        print(lines)
        train_log.print_start(run, args, processes.size)
        print(train_log.ROW_HEADER)
    log = train_log.Log(run, show=processes.rank == 0)
    stop = train(run, processes, log)
    speed = scaling(run, processes, log.step_seconds, train_step) if processes.size > 1 else None  # every rank
    if processes.rank == 0:
        train_log.finish(run, args, log, stop, info, speed)
    if isinstance(stop, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (interrupts.Terminated)
        return interrupts.exit_code(stop)
    return 1 if stop is not None else 0


# ---------------------------------------------------------------------------------------------------
# the start: settings, data, model, optimizer; new, or as a checkpoint left them


def start(args: argparse.Namespace, processes: Processes) -> Run:
    """The run the flags ask for: new (from --init-from's weights, or random ones) or as --out's checkpoint
    left it (--resume). A DataError, CheckpointError, SaveError or RunError says what does not fit."""
    if args.out and processes.rank == 0:  # the process that writes the checkpoints
        checkpoint.prepare_folder(args.out)  # writable, and cleared of what a killed run left; else a SaveError
    # the settings: each flag given, else as given to the run that wrote the checkpoint, else the preset's
    resumed = checkpoint.resumed(args)  # --out's checkpoint with --resume, else None
    base = resumed or checkpoint.initial(args)  # where the model and the tokenizer come from, if not new
    preset = base.preset if base else args.preset or "tiny"
    settings = train_flags.settings_of(args, PRESETS[preset], resumed.given if resumed else {})

    # the data: the text, its tokens, and its last part kept to validate on
    text, source = text_data.load_text(args.data)
    if resumed and text_data.fingerprint(text) != resumed.fingerprint:
        raise RunError(
            f"the checkpoint in {args.out} trained on {resumed.source} (fingerprint {resumed.fingerprint}); this "
            "text is another: give the same --data to resume"
        )
    tokenizer = text_data.tokenizer_of(args.tokenizer, text, base and base.tokenizer, base and base.folder)
    config = train_flags.model_config(
        args,
        PRESETS[preset],
        base and base.config,
        base and base.folder,
        tokenizer.vocab_size,
        settings.dropout,
    )
    train_flags.check_size(config, settings, processes.size)  # before anything of the step's size is allocated
    text_data.check_encoding(text, tokenizer, source)  # the tokens' memory, before they are made
    try:
        tokens = tokenizer.encode(text)  # (n,) token ids
    except text_data.DataError as err:  # only a checkpoint's tokenizer can lack what the text holds
        where = f"--init-from {args.init_from}" if args.init_from else f"the checkpoint in {args.out}"
        raise RunError(f"{where}: its tokenizer cannot spell {source}: {err}") from None
    validation = resumed.validation if resumed else args.validation or 0.1  # as the checkpoint keeps it
    train_tokens, val_tokens = text_data.split(tokens, config.context, validation, source)
    data = text_data.Data(tokenizer, source, text_data.fingerprint(text), validation, train_tokens, val_tokens)

    # the model and AdamW: weight decay on the matrices only, betas (0.9, β2)
    try:
        model = GPT(config, base.params if base else None, rng=args.seed)
    except AttentionMemoryError as err:  # a model whose weights alone do not fit
        raise RunError(str(err)) from None
    optimizer = AdamW(model.params, lr=settings.lr, betas=(0.9, settings.beta2), weight_decay=settings.weight_decay)
    batches, dropout = np.random.default_rng([args.seed, 1]), np.random.default_rng([args.seed, 2])
    run = Run(preset, settings, model, optimizer, data, args.seed, batches, dropout, out=args.out)
    if resumed:
        checkpoint.restore(run, resumed)  # AdamW's moments, both generators, the step, the rows, every loss
    return run


# ---------------------------------------------------------------------------------------------------
# the loop


def train(run: Run, processes: Processes, log: train_log.Log) -> BaseException | None:
    """Steps until --steps, with a validation and a checkpoint (in --out) every --eval-every steps and at the
    end. What stopped it early is returned: KeyboardInterrupt, or interrupts.Terminated for SIGTERM (after a
    checkpoint of where it stopped), NonFiniteLoss (the last checkpoint kept as it is) or a SaveError (a
    checkpoint that could not be written). Under --data-parallel a failure on one process ends every process,
    and Ctrl-C or SIGTERM stops them all after the same step."""
    s, T = run.settings, run.model.config.context
    mine = processes.rows(s.batch)  # this process's rows of every batch (all of them, alone)
    # the same windows each time
    val_batches = text_data.fixed_batches(run.data.val, s.eval_windows, s.batch, T)
    with StopTogether(sigterm=True) as ctrl_c, processes.guard():
        try:
            while True:
                # every --eval-every steps and at the end: the validation loss, a row, a checkpoint
                if (run.step % s.eval_every == 0 or run.step == s.steps) and not validated(run):
                    run.rows.append(log.row(run, evaluate(run.model, val_batches, processes)))
                    save(run, processes)
                if run.step >= s.steps:
                    break
                x, y = text_data.random_batch(run.rng, run.data.train, s.batch, T)  # (B, T) each, y one ahead
                began = time.perf_counter()
                loss = train_step(run, x[mine], y[mine], processes)
                run.history.append((run.step, loss))
                log.step(run, loss, time.perf_counter() - began)
                if processes.stop(ctrl_c):  # Ctrl-C or SIGTERM, on any process: all stop after this step
                    raise interrupts.Terminated() if ctrl_c.terminated else KeyboardInterrupt()
        except (KeyboardInterrupt, NonFiniteLoss, checkpoint.SaveError) as err:
            log.end_bar()
            if isinstance(err, KeyboardInterrupt):
                try:
                    save(run, processes)
                except checkpoint.SaveError as failed:
                    return failed
            return err
    log.end_bar()
    return None


def train_step(run: Run, x: np.ndarray, y: np.ndarray, processes: Processes) -> float:
    """One step on this process's rows x, y (b, T): the whole batch's loss. NonFiniteLoss, with nothing
    changed, where the loss or the gradient's norm is not finite."""
    s = run.settings
    loss_and_grads = partial(run.model.loss_and_grads, rng=run.dropout_rng if s.dropout else None)
    with warnings.catch_warnings():  # NumPy's overflow warnings: NonFiniteLoss says it once, with a cure
        warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
        # the mean over K slices of the rows
        loss, grads = accumulated_grads(loss_and_grads, x, y, s.accumulate)
        loss = processes.mean(loss, grads)  # the mean over the processes: one Allreduce (alone: as it is)
        norm = clip_grad_norm(grads, s.clip)  # ‖g‖ before; scaled down to ‖g‖ = clip where above it
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise NonFiniteLoss(run, loss, norm)
    lr = warmup_cosine_lr(run.step, lr=s.lr, warmup=s.warmup, total=s.steps, min_lr=s.min_lr)
    run.optimizer.step(run.model.params, grads, lr=lr)  # AdamW, in place
    run.step += 1
    return loss


def evaluate(model: GPT, batches: list[tuple[np.ndarray, ...]], processes: Processes) -> float:
    """The mean loss over the validation windows, no dropout; the processes share the batches out."""
    total = sum(model.loss(x, y) * len(x) for x, y in batches[processes.rank :: processes.size])
    return float(processes.total(total)) / sum(len(x) for x, _ in batches)


def validated(run: Run) -> bool:
    return bool(run.rows) and run.rows[-1].step == run.step


def save(run: Run, processes: Processes) -> None:
    """The run's state as a checkpoint in --out (rank 0 writes it; nothing without --out, or if saved already).
    A SaveError on every process where it could not be written (a full disk): the last one is kept."""
    if not run.out or run.saved_step == run.step:
        return
    failed = None
    if processes.rank == 0:
        try:
            checkpoint.save_run(run.out, run)
        except checkpoint.SaveError as err:
            failed = str(err)
    failed = processes.from_rank_0(failed)  # every process learns whether rank 0's write failed
    if failed:
        raise checkpoint.SaveError(failed)
    run.saved_step = run.step


class NonFiniteLoss(ArithmeticError):
    """The loss or the gradient's norm is inf or NaN: the step was not taken."""

    def __init__(self, run: Run, loss: float, norm: float):
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient's norm became {norm}"
        kept = f"; the last checkpoint, {run.out} at step {run.saved_step}, is kept" if run.out else ""
        super().__init__(
            f"{what} at step {run.step + 1}{kept}. Lower --lr (now {run.settings.lr:g}; the preset's is "
            f"{PRESETS[run.preset].lr:g}), or lengthen --warmup (now {run.settings.warmup}) or lower --clip "
            f"(now {run.settings.clip:g}), then run again" + (" with --resume" if run.out else "")
        )


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
