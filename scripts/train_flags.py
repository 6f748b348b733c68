"""train.py's flags and the settings they make: every flag's meaning and bounds, what the flags must satisfy
together, the presets (a model and how it trains), and Settings, a step's and the validations' settings as
typed fields, each a flag given now, else as given to the run that wrote the checkpoint, else the preset's.

    settings = settings_of(args, PRESETS["tiny"], given_before={})
    settings.lr, settings.warmup, settings.steps   # what warmup_cosine_lr is called with
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import copy_task
import limits
import outputs

from tinyattn_np.gpt import GPT_PRESETS, NORM_KINDS, POSITION_KINDS, GPTConfig
from tinyattn_np.layers import MLP_KINDS
from tinyattn_np.report import add_seed_and_format, nonnegative_seed, positive
from tinyattn_np.trainbill import training_memory

MAX_STEPS = 10_000_000  # more steps than any run on a CPU takes: a bigger number is a typo
MAX_BATCH = 4096
MAX_LAYERS, MAX_WIDTH = 1024, 2**16  # past them no model trains on a CPU: a bigger number is a typo
MAX_WINDOWS = 100_000  # validation windows, and tokens of the sample at the end
# the model's shape (GPTConfig's)
MODEL_FLAGS = ("layers", "heads", "width", "context", "mlp", "norm", "bias", "layer_pattern", "positions")


class RunError(ValueError):
    """Flags that do not fit the data or the checkpoint they name; the message says what to change."""


def fraction(text: str) -> float:
    """argparse type for --validation and --beta2: a number strictly between 0 and 1."""
    value = positive(float)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction between 0 and 1; got {value}")
    return float(value)


# each flag a checkpoint keeps -> its argparse type, which refuses what the flag may not be
FLAG_TYPES: dict[str, Callable[[str], Any]] = {
    "layers": positive(int, MAX_LAYERS),
    "heads": positive(int, limits.MAX_HEADS),
    "width": positive(int, MAX_WIDTH),
    "context": positive(int, limits.MAX_TOKENS),
    "steps": positive(int),
    "batch": positive(int),
    "accumulate": positive(int),
    "lr": positive(float),
    "min_lr": positive(float),
    "warmup": nonnegative_seed,
    "beta2": fraction,
    "weight_decay": float,
    "clip": positive(float),
    "dropout": float,
    "eval_every": positive(int),
    "eval_windows": positive(int),
}
INT_FLAGS = {
    "layers",
    "heads",
    "width",
    "context",
    "steps",
    "batch",
    "accumulate",
    "warmup",
    "eval_every",
    "eval_windows",
}


def cap_problem(name: str, value: Any) -> str | None:
    """Why a flag's value, of its type, is past the flag's cap (None where it is not): what check_args refuses
    beyond argparse's types."""
    flag = f"--{name.replace('_', '-')}"
    caps = {
        "steps": MAX_STEPS,
        "warmup": MAX_STEPS,
        "batch": MAX_BATCH,
        "accumulate": MAX_BATCH,
        "eval_windows": MAX_WINDOWS,
    }
    if name in caps and value > caps[name]:
        why = " (a run that long would not end on a CPU)" if name == "steps" else ""
        return f"{flag} must be at most {caps[name]:,}{why}; got {value:,}"
    if name in ("weight_decay", "dropout") and not 0 <= value < 1:
        return f"--weight-decay and --dropout must be numbers in [0, 1); got {flag} {value}"
    return None


def check_flag(name: str, value: Any) -> Any:
    """A flag's value read back from a checkpoint, passed through what the flag itself takes: its type (an int
    where the flag takes one) and its argparse type and cap, as if `--name value` were typed. A ValueError
    says why not."""
    kind = int if name in INT_FLAGS else float
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"--{name.replace('_', '-')} takes {'an int' if kind is int else 'a number'}")
    try:
        FLAG_TYPES[name](repr(value))
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise ValueError(f"--{name.replace('_', '-')}: {err}") from None
    problem = cap_problem(name, value)
    if problem:
        raise ValueError(problem)
    return value


@dataclass(frozen=True)
class Preset:
    """A model and how it trains: batch, peak learning rate, warm-up steps, AdamW's β2."""

    config: GPTConfig
    batch: int
    lr: float
    warmup: int
    beta2: float


PRESETS = {
    # nanoGPT's config/train_shakespeare_char.py with its CPU settings (batch 12, context 64, lr 1e-3,
    # β2 0.99)
    "tiny": Preset(GPT_PRESETS["tiny"], batch=12, lr=1e-3, warmup=100, beta2=0.99),
    "part3": Preset(GPT_PRESETS["part3"], batch=16, lr=6e-4, warmup=100, beta2=0.95),
}


@dataclass(frozen=True)
class Settings:
    """What a step does and when the run validates; the checkpoint keeps them (and `given`, the flags given,
    so that --resume goes on with them)."""

    steps: int  # AdamW steps in all
    batch: int  # sequences per step, over every process
    accumulate: int  # slices of a batch run one after another, their gradients summed
    lr: float  # the peak learning rate, after the warm-up
    min_lr: float  # where the cosine ends
    warmup: int  # steps of linear warm-up
    beta2: float  # AdamW's β2
    weight_decay: float  # AdamW's decay of the matrices
    clip: float  # the largest global gradient norm
    dropout: float  # on the embeddings and the residual branches
    eval_every: int  # steps between validations
    eval_windows: int  # validation windows
    given: dict[str, Any] = field(default_factory=dict)  # the flags of these that were given, by name


SETTINGS = tuple(f.name for f in fields(Settings) if f.name != "given")  # each a flag: --min-lr for min_lr


def settings_of(args: argparse.Namespace, preset: Preset, given_before: dict[str, Any]) -> Settings:
    """A flag given now, else as given to the run that wrote the checkpoint (given_before), else the default:
    the preset's; --min-lr follows --lr, --warmup follows --steps."""
    given = {
        **given_before,
        **{name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None},
    }
    values = {
        "steps": 100,
        "batch": preset.batch,
        "accumulate": 1,
        "lr": preset.lr,
        "weight_decay": 0.1,
        "beta2": preset.beta2,
        "clip": 1.0,
        "dropout": preset.config.dropout,
        "eval_every": 25,
        "eval_windows": 64,
        **given,
    }
    values.setdefault("min_lr", values["lr"] / 10)
    values.setdefault("warmup", min(preset.warmup, values["steps"] // 10))
    return Settings(**values, given=given)


def model_config(
    args: argparse.Namespace,
    preset: Preset,
    saved: GPTConfig | None,
    folder: str | None,
    vocab: int,
    dropout: float,
) -> GPTConfig:
    """The preset's model in the model flags' shape, or the checkpoint's (saved, in folder), which they must
    repeat (its weights fit its shape only)."""
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name, None) is not None}
    if saved is not None:
        other = [
            f"has {flag_text(n, getattr(saved, n))}, not {flag_text(n, v)}"
            for n, v in given.items()
            if getattr(saved, n) != v
        ]
        if other:
            raise RunError(
                f"the checkpoint in {folder} {'; '.join(other)}: that is another configuration; leave the model "
                "flags out to go on from it (its weights fit its shape only)"
            )
        return replace(saved, dropout=dropout)
    try:
        return replace(preset.config, **given, vocab=vocab, dropout=dropout)
    except ValueError as err:  # GPTConfig's check: the heads split the width into parts of an even size
        raise RunError(f"{' '.join(flag_text(n, v) for n, v in given.items())}: {err}") from None


def flag_text(name: str, value: Any) -> str:
    """A model flag as it is typed: '--width 128', '--bias', '--no-bias'."""
    flag = name.replace("_", "-")
    return f"--{'' if value else 'no-'}{flag}" if isinstance(value, bool) else f"--{flag} {value}"


def check_size(config: GPTConfig, settings: Settings, processes: int) -> None:
    """Refuse, before allocating, a batch that does not split over the processes and their --accumulate
    slices, or a step that needs more memory than this machine has (trainbill.training_memory: weights,
    gradients, AdamW's moments, what the forward keeps for the backward, at the step's peak; a validation
    batch keeps less)."""
    slices = processes * settings.accumulate
    if settings.batch % slices:
        raise RunError(
            f"--batch {settings.batch} does not split into {processes} process(es) x --accumulate "
            f"{settings.accumulate} equal slices: give a multiple of {slices}"
        )
    bill = training_memory(config, settings.batch // processes, accumulate=settings.accumulate)
    lower = "raise --accumulate, lower --batch or take a smaller model (--preset tiny, --width, --layers, --context)"
    detail = " (the weights, their gradients, AdamW's moments and the activations)"
    problem = limits.memory_problem(bill.peak, "a training step", lower, detail)
    if problem:
        raise RunError(problem)


# ---------------------------------------------------------------------------------------------------
# the flags


def add_task(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        choices=["gpt", "copy"],
        default="gpt",
        help="gpt: a language model on a text (default); copy: the copy task of copy_task.py (train.py --task "
        "copy --help lists its flags)",
    )


def add_model(p: argparse.ArgumentParser) -> None:
    """The flags of MODEL_FLAGS: the model's shape, each in place of the preset's (nanoGPT's n_layer, n_head,
    n_embd, block_size and bias), kept in the checkpoint; with --resume or --init-from they must repeat the
    checkpoint's."""
    p.add_argument("--layers", type=FLAG_TYPES["layers"], help="blocks (default: the preset's)")
    p.add_argument(
        "--heads",
        type=FLAG_TYPES["heads"],
        help="attention heads, each of width / heads channels, an even number (default: the preset's)",
    )
    p.add_argument(
        "--width",
        type=FLAG_TYPES["width"],
        help="C, the channels of every token (default: the preset's)",
    )
    p.add_argument(
        "--context",
        type=FLAG_TYPES["context"],
        help="the longest sequence trained on (default: the preset's)",
    )
    p.add_argument("--mlp", choices=MLP_KINDS, help="gelu (hidden 4C) or swiglu (hidden 8C/3) (default gelu)")
    p.add_argument("--norm", choices=NORM_KINDS, help="layernorm or rmsnorm (default layernorm)")
    p.add_argument(
        "--bias",
        action=argparse.BooleanOptionalAction,
        help="biases in the MLP and the norms (default: the preset's: "
        + ", ".join(f"{'biases' if preset.config.bias else 'none'} in {name}" for name, preset in PRESETS.items())
        + ")",
    )
    p.add_argument(
        "--layer-pattern",
        metavar="PATTERN",
        help="each block's mixer, one letter a layer, repeated over the layers: A softmax attention, L a gated delta "
        "layer (Qwen3-Next's Gated DeltaNet); LLLA is Qwen3-Next's three to one (default: A, attention in every block)",
    )
    p.add_argument(
        "--positions",
        choices=POSITION_KINDS,
        help="rope: q and k turned by RoPE in the attention (default); learned: a learned position table added to "
        "the embeddings, as nanoGPT's and GPT-2's",
    )


def add_settings(p: argparse.ArgumentParser) -> None:
    """The flags of SETTINGS' first part: what a step does, kept in the checkpoint."""
    p.add_argument(
        "--steps",
        type=FLAG_TYPES["steps"],
        help="AdamW steps in all (default 100; with --resume, the checkpoint's)",
    )
    p.add_argument("--batch", type=FLAG_TYPES["batch"], help="sequences per step (default: the preset's)")
    p.add_argument(
        "--accumulate",
        type=FLAG_TYPES["accumulate"],
        metavar="K",
        help="run each step's batch K equal slices at a time, their gradients summed (gradient accumulation): the "
        "same step to rounding, with one slice's activations in memory (default 1; nanoGPT's "
        "gradient_accumulation_steps multiplies its batch instead: its batch_size 12 with 4 steps is --batch 48 "
        "--accumulate 4)",
    )
    p.add_argument("--lr", type=FLAG_TYPES["lr"], help="the peak learning rate (default: the preset's)")
    p.add_argument("--min-lr", type=FLAG_TYPES["min_lr"], help="where the cosine ends (default: lr / 10)")
    p.add_argument(
        "--warmup",
        type=FLAG_TYPES["warmup"],
        help="steps of linear warm-up (default: 100, at most a tenth of --steps)",
    )
    p.add_argument(
        "--beta2",
        type=FLAG_TYPES["beta2"],
        help="AdamW's β2, how slowly its second moment forgets (default: the preset's, 0.99 or 0.95)",
    )
    p.add_argument(
        "--weight-decay", type=FLAG_TYPES["weight_decay"], help="AdamW's decay of the matrices (default 0.1)"
    )
    p.add_argument("--clip", type=FLAG_TYPES["clip"], help="the largest global gradient norm (default 1)")
    p.add_argument(
        "--dropout",
        type=FLAG_TYPES["dropout"],
        help="dropout on the embeddings and residual branches (default: the preset's, 0)",
    )


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """train.py's flags (description: its --help's text); with --task copy, copy_task.py's."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)  # --task decides which flags there are
    add_task(pre)
    task, _ = pre.parse_known_args(argv)
    if task.task == "copy":
        return copy_task.parse_args(argv, add_task, prog="train.py --task copy")
    p = argparse.ArgumentParser(
        prog="train.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_task(p)
    add_data(p)
    add_model(p)
    add_settings(p)
    add_run(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_data(p: argparse.ArgumentParser) -> None:
    """The text, its tokenizer and the model's preset."""
    p.add_argument("--data", metavar="PATH", help="a UTF-8 text file (default: this project's README.md and docs/)")
    p.add_argument(
        "--tokenizer",
        metavar="char|byte|PATH.json",
        help="characters (default), UTF-8 bytes, or a Hugging Face tokenizer.json (the tokenizers extra); with "
        "--resume or --init-from, the checkpoint's",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="the model and its training settings (default tiny; with --resume or --init-from, the checkpoint's)",
    )


def add_run(p: argparse.ArgumentParser) -> None:
    """The validations, the checkpoints, the processes and what the run writes."""
    p.add_argument(
        "--validation",
        type=fraction,
        help="the text's last part kept to validate on (default 0.1; with --resume, the checkpoint's)",
    )
    p.add_argument(
        "--eval-every",
        type=FLAG_TYPES["eval_every"],
        help="steps between validations (default 25; with --resume, the checkpoint's)",
    )
    p.add_argument(
        "--eval-windows",
        type=FLAG_TYPES["eval_windows"],
        help="validation windows (default 64; with --resume, the checkpoint's)",
    )
    p.add_argument("--out", metavar="DIR", help="write checkpoints in DIR (sample.py DIR reads them)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out DIR")
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start a new run from the weights of DIR's checkpoint, its model and its tokenizer, with a new AdamW "
        "from step 0, on --data (fine-tuning)",
    )
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the flags must satisfy together, before anything is read or allocated."""
    for name in SETTINGS:
        problem = getattr(args, name) is not None and cap_problem(name, getattr(args, name))
        if problem:
            p.error(problem)
    if not 0 <= args.sample <= MAX_WINDOWS:
        p.error(f"--sample must be between 0 and {MAX_WINDOWS:,}; got {args.sample:,}")
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
