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
part3 a 6-layer model of width 256 and context 256; --layers, --heads, --width, --context, --mlp, --norm
and --bias change the preset's model. The vocabulary is the tokenizer's: the characters of the text
(--tokenizer char, the default), its UTF-8 bytes (byte), or a Hugging Face tokenizer.json. The text is cut
into a training part and the last --validation of it, which is never trained on. A step: a batch of random
windows, the loss and every gradient (GPT.loss_and_grads), clipping of the global norm to --clip, and AdamW
with a linear warm-up and a cosine decay (tinyattn_np.optim). --accumulate K runs the batch K equal slices at
a time, their gradients summed: the same step, with one slice's activations in memory.

With --out DIR, a checkpoint (checkpoint.py: the weights, AdamW's moments, the configuration, the data's
fingerprint and the random generators' states) is written at every validation, at the end and on Ctrl-C.
--resume continues it, to the same bits as a run that was never stopped (the flags given to the run that wrote
it hold unless given again: a step's settings, --eval-every, --eval-windows). A loss that is not finite (a
learning rate far too large) stops the run, keeps the last checkpoint as it was and says what to change.
Under mpiexec, --data-parallel gives each process an equal slice of every batch and averages the gradients
with one Allreduce: the same losses as one process with the whole batch, to float32 rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tinyattn_np.report import add_seed_and_format

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import blas_idle  # noqa: E402

if __name__ == "__main__":  # a program's setting, made before NumPy loads OpenBLAS (blas_idle.py says why)
    blas_idle.shorten_spin()
import checkpoint  # noqa: E402
import copy_task  # noqa: E402
import interrupts
import limits
import machine
import outputs
import text_data  # noqa: E402
import training  # noqa: E402

from tinyattn_np import format_bytes
from tinyattn_np.gpt import NORM_KINDS
from tinyattn_np.layers import MLP_KINDS
from tinyattn_np.report import fold_lines, nonnegative_seed, positive
from tinyattn_np.trainbill import training_memory  # noqa: E402

MAX_STEPS = 10_000_000  # more steps than any run on a CPU takes: a bigger number is a typo
MAX_BATCH = 4096
MAX_LAYERS, MAX_WIDTH = 1024, 2**16  # past them no model trains on a CPU: a bigger number is a typo


def add_task(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=["gpt", "copy"], default="gpt",
                   help="gpt: a language model on a text (default); copy: the copy task of copy_task.py "
                   "(train.py --task copy --help lists its flags)")  # fmt: skip


def fraction(text: str) -> float:
    """argparse type for --validation and --beta2: a number strictly between 0 and 1."""
    value = positive(float)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction between 0 and 1; got {value}")
    return float(value)


def add_model(p: argparse.ArgumentParser) -> None:
    """The flags of training.MODEL_FLAGS: the model's shape, each in place of the preset's (nanoGPT's n_layer,
    n_head, n_embd, block_size and bias), kept in the checkpoint; with --resume or --init-from they must repeat
    the checkpoint's."""
    p.add_argument("--layers", type=positive(int, MAX_LAYERS), help="blocks (default: the preset's)")
    p.add_argument("--heads", type=positive(int, limits.MAX_HEADS), help="attention heads, each of width / heads "
                   "channels, an even number (default: the preset's)")  # fmt: skip
    p.add_argument("--width", type=positive(int, MAX_WIDTH), help="C, the channels of every token (default: the "
                   "preset's)")  # fmt: skip
    p.add_argument("--context", type=positive(int, limits.MAX_TOKENS), help="the longest sequence trained on "
                   "(default: the preset's)")  # fmt: skip
    p.add_argument("--mlp", choices=MLP_KINDS, help="gelu (hidden 4C) or swiglu (hidden 8C/3) (default gelu)")
    p.add_argument("--norm", choices=NORM_KINDS, help="layernorm or rmsnorm (default layernorm)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, help="biases in the MLP and the norms "
                   "(default: none)")  # fmt: skip


def add_settings(p: argparse.ArgumentParser) -> None:
    """The flags of training.SETTINGS: what a step does, kept in the checkpoint."""
    p.add_argument("--steps", type=positive(int), help="AdamW steps in all (default 100; with --resume, the "
                   "checkpoint's)")  # fmt: skip
    p.add_argument("--batch", type=positive(int), help="sequences per step (default: the preset's)")
    p.add_argument("--accumulate", type=positive(int), metavar="K", help="run each step's batch K equal slices at a "
                   "time, their gradients summed (gradient accumulation): the same step to rounding, with one "
                   "slice's activations in memory (default 1; nanoGPT's gradient_accumulation_steps multiplies its "
                   "batch instead: its batch_size 12 with 4 steps is --batch 48 --accumulate 4)")  # fmt: skip
    p.add_argument("--lr", type=positive(float), help="the peak learning rate (default: the preset's)")
    p.add_argument("--min-lr", type=positive(float), help="where the cosine ends (default: lr / 10)")
    p.add_argument("--warmup", type=nonnegative_seed, help="steps of linear warm-up (default: 100, at most a "
                   "tenth of --steps)")  # fmt: skip
    p.add_argument("--beta2", type=fraction, help="AdamW's β2, how slowly its second moment forgets (default: the "
                   "preset's, 0.99 or 0.95)")  # fmt: skip
    p.add_argument("--weight-decay", type=float, help="AdamW's decay of the matrices (default 0.1)")
    p.add_argument("--clip", type=positive(float), help="the largest global gradient norm (default 1)")
    p.add_argument("--dropout", type=float, help="dropout on the embeddings and residual branches (default: "
                   "the preset's, 0)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)  # --task decides which flags there are
    add_task(pre)
    task, _ = pre.parse_known_args(argv)
    if task.task == "copy":
        return copy_task.parse_args(argv, add_task, prog="train.py --task copy")
    p = argparse.ArgumentParser(prog="train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_task(p)
    p.add_argument("--data", metavar="PATH", help="a UTF-8 text file (default: this project's README.md and docs/)")
    p.add_argument(
        "--tokenizer",
        metavar="char|byte|PATH.json",
        help="characters (default), UTF-8 bytes, or a Hugging Face tokenizer.json (the tokenizers extra); with "
        "--resume or --init-from, the checkpoint's",
    )
    p.add_argument(
        "--preset",
        choices=sorted(training.PRESETS),
        default=None,
        help="the model and its training settings (default tiny; with --resume or --init-from, the checkpoint's)",
    )
    add_model(p)
    add_settings(p)
    p.add_argument("--validation", type=fraction, help="the text's last part kept to validate on (default 0.1; "
                   "with --resume, the checkpoint's)")  # fmt: skip
    p.add_argument("--eval-every", type=positive(int), help="steps between validations (default 25; with --resume, "
                   "the checkpoint's)")  # fmt: skip
    p.add_argument("--eval-windows", type=positive(int), help="validation windows (default 64; with --resume, the "
                   "checkpoint's)")  # fmt: skip
    p.add_argument("--out", metavar="DIR", help="write checkpoints in DIR (sample.py DIR reads them)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out DIR")
    p.add_argument("--init-from", metavar="DIR", help="start a new run from the weights of DIR's checkpoint, its "
                   "model and its tokenizer, with a new AdamW from step 0, on --data (fine-tuning)")  # fmt: skip
    p.add_argument(
        "--data-parallel",
        action="store_true",
        help="under mpiexec -n P: each process takes 1/P of every batch, the gradients averaged",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=200,
        metavar="N",
        help="print N tokens sampled from the model at the end (default 200; 0: none)",
    )
    outputs.add_plot_arguments(p, "the loss curve")
    p.add_argument("--json", metavar="PATH", help="write the table's figures, the machine and the code version to PATH")
    add_seed_and_format(p, "the weights, the batches and dropout")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the flags must satisfy together, before anything is read or allocated."""
    if args.steps is not None and args.steps > MAX_STEPS:
        p.error(f"--steps must be at most {MAX_STEPS:,} (a run that long would not end on a CPU); got {args.steps:,}")
    for flag, value in (("--batch", args.batch), ("--accumulate", args.accumulate)):
        if value is not None and value > MAX_BATCH:
            p.error(f"{flag} must be at most {MAX_BATCH:,}; got {value:,}")
    if any(value is not None and not 0 <= value < 1 for value in (args.weight_decay, args.dropout)):
        p.error("--weight-decay and --dropout must be numbers in [0, 1)")
    if (args.eval_windows or 0) > 100_000 or not 0 <= args.sample <= 100_000:
        p.error("--eval-windows and --sample must be at most 100,000 (--sample may be 0)")
    if args.resume and args.out is None:
        p.error("--resume continues the checkpoint in --out DIR: give --out")
    if args.init_from is not None and args.resume:
        p.error("--init-from starts a new run and --resume continues one: give one of them")
    both = args.init_from is not None and args.out is not None
    if both and Path(args.init_from).resolve() == Path(args.out).resolve():
        p.error(f"--out {args.out} is --init-from's own folder: give the new run another --out")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file: give a folder (it is made if missing)")
    outputs.check_output(p, "--json", args.json)
    outputs.check_plot(p, args.plot, args.overwrite)


# ---------------------------------------------------------------------------------------------------
# the run


def print_start(run: training.Run, size: int) -> None:
    c, s = run.model.config, run.settings
    print(
        f"data: {run.source}: {len(run.train) + len(run.val):,} tokens ({run.tokenizer.describe()['kind']} "
        f"tokenizer, vocabulary {c.vocab:,});\n  {len(run.train):,} to train on, {len(run.val):,} to validate on"
    )
    preset = training.PRESETS[run.preset].config
    changed = ", ".join(name for name in training.MODEL_FLAGS if getattr(c, name) != getattr(preset, name))
    changed = f"; not the preset's: {changed}" if changed else ""  # the model flags' doing, new or resumed
    print(
        f"model: GPT ({run.preset}), {c.layers} layer{'s' * (c.layers != 1)}, {c.heads} head{'s' * (c.heads != 1)}, "
        f"width {c.width}, context {c.context}, {c.mlp} MLP of {c.hidden}, {c.norm}{' with biases' * c.bias},\n"
        f"  tied head: {run.model.num_parameters:,} parameters ({c.dtype}){changed}"
    )
    split = f" split over {size} processes" if size > 1 else ""
    slices = ""
    if s["accumulate"] > 1:
        rows, each = s["batch"] // size // s["accumulate"], " a process" if size > 1 else ""  # sequences in a slice
        slices = f",\n  in {s['accumulate']} slices of {rows} sequence{'s' * (rows != 1)}{each} (gradient accumulation)"
    print(f"training: AdamW (lr {s['lr']:g} -> {s['min_lr']:g}, warm-up {s['warmup']} steps, cosine to step "
          f"{s['steps']}, β2 {s['beta2']:g}, weight decay {s['weight_decay']:g}),\n  clip {s['clip']:g}, batch "
          f"{s['batch']} x {c.context} tokens{split}{slices}")  # fmt: skip
    bill = training_memory(c, s["batch"] // size, accumulate=s["accumulate"])
    names = ("weights", "moments", "activations") + (("accumulated",) if bill.accumulated else ())
    parts = ", ".join(f"{name} {format_bytes(getattr(bill, name))}" for name in names)
    print(f"memory of a step: {format_bytes(bill.peak)} at its peak\n  ({parts}; trainbill.training_memory)")
    if run.args.data_parallel and size == 1:
        print("ran 1 process, so nothing was split; for 2: mpiexec -n 2 python scripts/train.py --data-parallel")
    if run.step:
        print(f"resumed from {run.args.out} at step {run.step}")
    elif run.args.init_from:
        print(f"started from the weights of the checkpoint in {run.args.init_from} (--init-from)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.task == "copy":
        return copy_task.run(args)
    comm = training.communicator(args)
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    try:
        run = training.start(args, size)
    except (text_data.DataError, checkpoint.CheckpointError, training.RunError) as err:
        if rank == 0:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    info = None
    if rank == 0:
        info, lines = machine.header()
        print(lines)
        print_start(run, size)
        print(training.ROW_HEADER)
    stop = training.train(run, comm)
    scaling = training.scaling(run, comm) if comm is not None and size > 1 else None  # every rank takes part
    if rank != 0:
        return training.exit_code(stop)
    return finish(run, stop, info, scaling)


def finish(run: training.Run, stop: BaseException | None, info: Any, scaling: str | None) -> int:
    """Rank 0 after the loop: the last lines, the sample, the plot, --json; the exit code."""
    args = run.args
    seconds = sum(run.step_seconds)
    tokens = len(run.step_seconds) * run.settings["batch"] * run.model.config.context
    busy = machine.busy_reasons()
    print(f"{len(run.step_seconds)} steps in {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
          + (f" (* timed on a busy machine: {'; '.join(busy)})" if busy else ""))  # fmt: skip
    if scaling:
        print(scaling)
    if stop is None and args.sample:
        text, prompt = training.sample(run, args.sample)
        print(f"\nsample ({args.sample} tokens after {prompt}, temperature 0.8, seed {args.seed}; lines over 120 "
              "characters folded):")  # fmt: skip
        print(fold_lines(text))
    if args.out:
        print(f"checkpoint: {args.out} (step {run.saved_step}); python scripts/sample.py {args.out}")
    if args.plot and run.history:
        plot_losses(run, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        figures = {"machine": info, "args": vars(args), "settings": run.settings, "validation": run.validation,
                   "seconds": seconds, "busy": busy, "rows": run.rows,
                   "stopped": None if stop is None else str(stop) or "Ctrl-C"}  # fmt: skip
        outputs.write_json(args.json, figures, isinstance(stop, KeyboardInterrupt))
    if isinstance(stop, training.NonFiniteLoss):
        print(f"train.py: stopped: {stop}", file=sys.stderr)
    elif isinstance(stop, KeyboardInterrupt):
        return interrupts.interrupted(run.step, run.settings["steps"], "steps")
    return training.exit_code(stop)


def plot_losses(run: training.Run, path: str) -> None:
    """The training loss of every step and the validation loss of every row, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*run.history, strict=True) if run.history else ((), ())
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="training loss (each step's batch)")
    rows = [r for r in run.rows if r["val_loss"] is not None]
    ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], "o-", label="validation loss")
    c = run.model.config
    ax.set_title(f"{run.preset}: {c.layers} layers, width {c.width}, {run.model.num_parameters:,} parameters; "
                 f"{run.source}", fontsize=10)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    training.keep_freed_memory()  # every step makes the same arrays: their memory is kept, not faulted in again
    sys.exit(interrupts.run_main(main))
