"""The GPT's training run: its settings, one step, the loop with its validations and checkpoints, and the
processes of --data-parallel. A module that train.py and train_speed.py share.

One step, the whole of it (train_step):

    x, y = B random windows of the training tokens, y one token ahead     (B, T) each
    loss, grads = model.loss_and_grads(x, y)                              every gradient by hand (gpt.py);
                                                                          --accumulate K: K slices of B / K
                                                                          rows, the mean (accumulated_grads)
    grads = the mean over the processes (one Allreduce; --data-parallel only)
    ‖g‖ = clip_grad_norm(grads, clip)                                     scaled down to ‖g‖ = clip if above it
    optimizer.step(params, grads, lr=warmup_cosine_lr(step, ...))         AdamW (optim.py)

A run's state is the model's weights, AdamW's moments and step count, and the two random generators (the
batches', which is where the data stands, and dropout's). A checkpoint holds all of it, so that a run resumed
from one draws the same batches and takes the same steps as a run that never stopped: the same bits. A loss
or a gradient norm that is not finite stops the loop and writes no checkpoint: the last one, from the last
validation, stays as the one to go on from with a lower learning rate.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import math
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import checkpoint
import interrupts
import limits
import numpy as np
import outputs
import text_data

from tinyattn_np.gpt import GPT, GPT_PRESETS, GPTConfig
from tinyattn_np.mpi_job import StopTogether, abort_on_failure, idle_wait, load_mpi
from tinyattn_np.optim import AdamW, accumulated_grads, clip_grad_norm, warmup_cosine_lr
from tinyattn_np.sampling import generate
from tinyattn_np.trainbill import training_memory


@dataclass(frozen=True)
class Preset:
    """A model and how it trains: batch, peak learning rate, warm-up steps, AdamW's β2."""

    config: GPTConfig
    batch: int
    lr: float
    warmup: int
    beta2: float


PRESETS = {
    # nanoGPT's config/train_shakespeare_char.py with its CPU settings (batch 12, context 64, lr 1e-3, β2 0.99)
    "tiny": Preset(GPT_PRESETS["tiny"], batch=12, lr=1e-3, warmup=100, beta2=0.99),
    "part3": Preset(GPT_PRESETS["part3"], batch=16, lr=6e-4, warmup=100, beta2=0.95),
}
SETTINGS = ("steps", "batch", "accumulate", "lr", "min_lr", "warmup", "beta2", "weight_decay", "clip", "dropout",
            "eval_every", "eval_windows")  # a step's, and the validations'; the checkpoint keeps them  # fmt: skip
MODEL_FLAGS = ("layers", "heads", "width", "context", "mlp", "norm", "bias")  # the model's shape (GPTConfig's names)
ROW_HEADER = f"{'step':>7}  {'train loss':>10}  {'val loss':>8}  {'lr':>9}  {'tokens/s':>9}  {'time':>8}"


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h: mallopt's two settings that keep memory
freed_memory_kept = False  # whether keep_freed_memory() took in this process


def keep_freed_memory() -> bool:
    """Ask glibc's malloc (mallopt) to keep the memory of freed arrays for the next ones, up to 1 GiB, instead
    of handing it back to the system: a training step frees and makes the same large arrays every step, and an
    array made in memory that was handed back faults its pages in again one by one, in the system's time. The
    process keeps its peak memory in exchange. Returns whether it took: False where the C library is not glibc.
    A setting of the whole process: the scripts make it where they start as programs (their __main__), never
    in main(), which a test or a notebook may call in its own process."""
    global freed_memory_kept
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return False
    freed_memory_kept = bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    return freed_memory_kept


class RunError(ValueError):
    """Flags that do not fit the data or the checkpoint they name; the message says what to change."""


class NonFiniteLoss(ArithmeticError):
    """The loss or the gradient's norm is inf or NaN: the step was not taken."""

    def __init__(self, run: Run, loss: float, norm: float):
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient's norm became {norm}"
        kept = f"; the last checkpoint, {run.args.out} at step {run.saved_step}, is kept" if run.args.out else ""
        super().__init__(
            f"{what} at step {run.step + 1}{kept}. Lower --lr (now {run.settings['lr']:g}; the preset's is "
            f"{PRESETS[run.preset].lr:g}), or lengthen --warmup (now {run.settings['warmup']}) or lower --clip "
            f"(now {run.settings['clip']:g}), then run again" + (" with --resume" if run.args.out else "")
        )


@dataclass
class Run:
    """Everything a training run holds; start() makes it, train() moves it on."""

    args: argparse.Namespace
    preset: str
    settings: dict[str, Any]  # SETTINGS' values, as given or from the preset and the checkpoint
    model: GPT
    optimizer: AdamW
    tokenizer: Any
    source: str  # where the text came from
    fingerprint: str
    validation: float  # the text's last part validated on, never trained on
    train: np.ndarray  # (n_train,) token ids
    val: np.ndarray  # (n_val,)
    rng: np.random.Generator  # the batches'
    dropout_rng: np.random.Generator
    step: int = 0  # steps taken
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss) of every step
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per validation
    step_seconds: list[float] = field(default_factory=list)  # this session's steps
    allreduce_seconds: list[float] = field(default_factory=list)
    saved_step: int | None = None
    bar: bool = False  # whether the progress bar's line is open on stderr


# ---------------------------------------------------------------------------------------------------
# the start: new, or resumed from a checkpoint


def settings_of(args: argparse.Namespace, preset: Preset, given_before: dict[str, Any]) -> dict[str, Any]:
    """SETTINGS: a flag given now, else as given to the run that wrote the checkpoint, else the default
    (the preset's; --min-lr follows --lr, --warmup follows --steps). Under "given", the flags given."""
    defaults = {"steps": 100, "batch": preset.batch, "accumulate": 1, "lr": preset.lr, "weight_decay": 0.1,
                "beta2": preset.beta2, "clip": 1.0, "dropout": preset.config.dropout, "eval_every": 25,
                "eval_windows": 64}  # fmt: skip
    given = {**given_before, **{name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}}
    settings = {**defaults, **given}
    settings.setdefault("min_lr", settings["lr"] / 10)
    settings.setdefault("warmup", min(preset.warmup, settings["steps"] // 10))
    return {**settings, "given": given}


def resumed(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta) of --out's checkpoint with --resume; ({}, {}) for a new run, whose --out must hold none."""
    if not args.out:
        return {}, {}
    if not args.resume:
        if checkpoint.exists(args.out):
            raise RunError(f"--out {args.out} holds a checkpoint already: add --resume to continue it, or give "
                           "another --out")  # fmt: skip
        return {}, {}
    arrays, meta = checkpoint.load(args.out)
    if args.steps is not None and args.steps <= meta["step"]:
        raise RunError(f"the checkpoint in {args.out} is at step {meta['step']} already: give --steps above it")
    check_preset(args, meta, args.out)
    if args.validation not in (None, meta["data"]["validation"]):  # another split would train on other windows
        raise RunError(f"the checkpoint in {args.out} validates on the last {meta['data']['validation']:g} of its "
                       f"text; --validation {args.validation:g} is another split: leave it out to resume")  # fmt: skip
    return arrays, meta


def initial(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta) of --init-from's checkpoint, whose model, tokenizer and weights a new run starts from (its
    AdamW, step and data are not taken: fine-tuning, nanoGPT's init_from); ({}, {}) without the flag."""
    if not args.init_from:
        return {}, {}
    arrays, meta = checkpoint.load(args.init_from)  # a CheckpointError names the folder
    check_preset(args, meta, args.init_from)
    return arrays, meta


def check_preset(args: argparse.Namespace, meta: dict[str, Any], folder: str) -> None:
    if args.preset is not None and args.preset != meta["preset"]:  # the checkpoint's preset is the run's
        raise RunError(f"the checkpoint in {folder} is a {meta['preset']} model; --preset {args.preset} is another "
                       "configuration: leave --preset out to go on from it")  # fmt: skip


def start(args: argparse.Namespace, processes: int) -> Run:
    """The run the flags ask for: the text read and tokenized, the model and AdamW, new (from --init-from's weights,
    or random ones) or as --out's checkpoint left them. A DataError, CheckpointError or RunError says what does not
    fit."""
    arrays, meta = resumed(args)
    weights, base = (arrays, meta) if meta else initial(args)  # the checkpoint the model and the tokenizer come from
    preset_name = base.get("preset") or args.preset or "tiny"
    preset = PRESETS[preset_name]
    settings = settings_of(args, preset, meta.get("settings", {}).get("given", {}))
    text, source = text_data.load_text(args.data)
    if meta and text_data.fingerprint(text) != meta["data"]["fingerprint"]:
        trained_on = f"{meta['data']['source']} (fingerprint {meta['data']['fingerprint']})"
        raise RunError(f"the checkpoint in {args.out} trained on {trained_on}; this text is another: give the "
                       "same --data to resume")  # fmt: skip
    folder = args.out if meta else args.init_from  # where base came from
    tokenizer = text_data.tokenizer_of(args.tokenizer, text, base.get("tokenizer"), folder)
    config = model_config(args, preset, base, folder, tokenizer.vocab_size, settings["dropout"])
    check_size(config, settings, processes)
    try:
        tokens = tokenizer.encode(text)
    except text_data.DataError as err:  # only --init-from's tokenizer can lack what the text holds
        raise RunError(f"--init-from {args.init_from}: its tokenizer cannot spell {source}: {err}") from None
    validation = meta["data"]["validation"] if meta else args.validation or 0.1  # as the checkpoint keeps it
    train, val = text_data.split(tokens, config.context, validation, source)
    params = {name.removeprefix("param."): a for name, a in weights.items() if name.startswith("param.")}
    model = GPT(config, params or None, rng=args.seed)
    optimizer = AdamW(model.params, lr=settings["lr"], betas=(0.9, settings["beta2"]),
                      weight_decay=settings["weight_decay"])  # fmt: skip
    run = Run(args, preset_name, settings, model, optimizer, tokenizer, source, text_data.fingerprint(text), validation,
              train, val, np.random.default_rng([args.seed, 1]), np.random.default_rng([args.seed, 2]))  # fmt: skip
    if meta:
        optimizer.load_state_dict({k.removeprefix("adamw."): a for k, a in arrays.items() if k.startswith("adamw.")})
        run.rng, run.dropout_rng = text_data.rng_from(meta["rng"]), text_data.rng_from(meta["dropout_rng"])
        run.step, run.saved_step, run.rows = meta["step"], meta["step"], meta["rows"]
        run.history = [(int(s), float(loss)) for s, loss in arrays["history"]]
    return run


def model_config(args: argparse.Namespace, preset: Preset, meta: dict, folder: str | None, vocab: int,
                 dropout: float) -> GPTConfig:  # fmt: skip
    """The preset's model in the model flags' shape, or the checkpoint's (meta, in folder), which they must repeat."""
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name, None) is not None}
    if meta:
        config = GPTConfig.from_dict(meta["config"])
        other = [f"has {flag_text(n, getattr(config, n))}, not {flag_text(n, v)}" for n, v in given.items()
                 if getattr(config, n) != v]  # fmt: skip
        if other:
            raise RunError(f"the checkpoint in {folder} {'; '.join(other)}: that is another configuration; leave "
                           "the model flags out to go on from it (its weights fit its shape only)")  # fmt: skip
        return replace(config, dropout=dropout)
    try:
        return replace(preset.config, **given, vocab=vocab, dropout=dropout)
    except ValueError as err:  # GPTConfig's check: the heads split the width into parts of an even size
        raise RunError(f"{' '.join(flag_text(n, v) for n, v in given.items())}: {err}") from None


def flag_text(name: str, value: Any) -> str:
    """A model flag as it is typed: '--width 128', '--bias', '--no-bias'."""
    return f"--{'' if value else 'no-'}{name}" if isinstance(value, bool) else f"--{name} {value}"


def check_size(config: GPTConfig, settings: dict[str, Any], processes: int) -> None:
    """Refuse, before allocating, a batch that does not split over the processes and their --accumulate slices,
    or a step that needs more memory than this machine has (trainbill.training_memory: weights, gradients,
    AdamW's moments, what the forward keeps for the backward, at the step's peak; a validation batch keeps less)."""
    batch, slices = settings["batch"], processes * settings["accumulate"]
    if batch % slices:
        raise RunError(f"--batch {batch} does not split into {processes} process(es) x --accumulate "
                       f"{settings['accumulate']} equal slices: give a multiple of {slices}")  # fmt: skip
    bill = training_memory(config, batch // processes, accumulate=settings["accumulate"])
    problem = limits.memory_problem(bill.peak, "a training step", "raise --accumulate, lower --batch or take a "
                                    "smaller model (--preset tiny, --width, --layers, --context)", " (the weights, "
                                    "their gradients, AdamW's moments and the activations)")  # fmt: skip
    if problem:
        raise RunError(problem)


# ---------------------------------------------------------------------------------------------------
# one step, and the loop


def train_step(run: Run, x: np.ndarray, y: np.ndarray, comm: Any = None) -> float:
    """The module docstring's step on this process's rows x, y (b, T); the whole batch's loss. Raises
    NonFiniteLoss, with nothing changed, where the loss or the gradient norm is not finite."""
    dropout_rng = run.dropout_rng if run.model.config.dropout else None
    with warnings.catch_warnings():  # NumPy's overflow warnings: NonFiniteLoss says it once, with a cure
        warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
        loss_and_grads = partial(run.model.loss_and_grads, rng=dropout_rng)
        loss, grads = accumulated_grads(loss_and_grads, x, y, run.settings["accumulate"])
        if comm is not None:
            loss = allreduce_mean(run, comm, loss, grads)
        norm = clip_grad_norm(grads, run.settings["clip"])
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise NonFiniteLoss(run, loss, norm)
    s = run.settings
    lr = warmup_cosine_lr(run.step, lr=s["lr"], warmup=s["warmup"], total=s["steps"], min_lr=s["min_lr"])
    run.optimizer.step(run.model.params, grads, lr=lr)
    run.step += 1
    return loss


def allreduce_mean(run: Run, comm: Any, loss: float, grads: dict[str, np.ndarray]) -> float:
    """Every gradient, in place, and the loss: the mean over the processes. Each process's are the means
    over its equal share of the batch, so their mean is the whole batch's. One Allreduce of one buffer."""
    MPI = load_mpi()
    start = time.perf_counter()
    flat = np.concatenate([g.ravel() for g in grads.values()])  # (number of parameters,)
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    flat /= comm.Get_size()
    offset = 0
    for g in grads.values():
        g[...] = flat[offset : offset + g.size].reshape(g.shape)
        offset += g.size
    run.allreduce_seconds.append(time.perf_counter() - start)
    return float(comm.allreduce(loss, op=MPI.SUM)) / comm.Get_size()


def validate(run: Run, comm: Any = None) -> float:
    """The mean loss over the fixed validation windows, no dropout; the processes share them out."""
    T = run.model.config.context
    batches = text_data.fixed_batches(run.val, run.settings["eval_windows"], run.settings["batch"], T)
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    total = sum(run.model.loss(x, y) * len(x) for x, y in batches[rank::size])
    if comm is not None:
        total = comm.allreduce(total, op=load_mpi().SUM)
    return float(total) / sum(len(x) for x, _ in batches)


def train(run: Run, comm: Any = None) -> BaseException | None:
    """Steps until --steps, a validation (and a checkpoint) every --eval-every and at the end. What stopped
    it early is returned: KeyboardInterrupt (after a checkpoint of where it stopped) or NonFiniteLoss (the
    last checkpoint kept as it is). Under --data-parallel a failure on one process ends every process
    (abort_on_failure), and Ctrl-C stops them all after the same step."""
    guard = abort_on_failure(comm, "train.py --data-parallel") if comm is not None else nullcontext()
    with StopTogether() as ctrl_c, guard:
        try:
            loop(run, comm, ctrl_c)
        except (KeyboardInterrupt, NonFiniteLoss) as err:
            end_bar(run)
            if isinstance(err, KeyboardInterrupt):
                save(run, comm)
            return err
    end_bar(run)
    return None


def loop(run: Run, comm: Any, ctrl_c: StopTogether) -> None:
    """The steps, until --steps or Ctrl-C; each process takes its rows of every batch."""
    T, total = run.model.config.context, run.settings["steps"]
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    mine = slice(rank * run.settings["batch"] // size, (rank + 1) * run.settings["batch"] // size)
    first, shown = run.step, 0.0
    while True:
        if (run.step % run.settings["eval_every"] == 0 or run.step == total) and not validated(run):
            record(run, validate(run, comm), rank == 0)
            save(run, comm)
        if run.step >= total:
            return
        x, y = text_data.random_batch(run.rng, run.train, run.settings["batch"], T)  # (B, T) each
        began = time.perf_counter()
        loss = train_step(run, x[mine], y[mine], comm)
        run.step_seconds.append(time.perf_counter() - began)
        run.history.append((run.step, loss))
        if rank == 0 and run.step - first == 2:
            say_how_long(run)
        if rank == 0 and (time.perf_counter() - shown > 0.25 or run.step == total):
            shown = time.perf_counter()
            progress_bar(run, loss)
        if ctrl_c.stop(comm) if comm is not None else ctrl_c.pressed:
            raise KeyboardInterrupt


def validated(run: Run) -> bool:
    return bool(run.rows) and run.rows[-1]["step"] == run.step


# ---------------------------------------------------------------------------------------------------
# what the run prints and keeps


def record(run: Run, val_loss: float, show: bool) -> None:
    """A row of the table: the training loss (the mean of the steps since the last row), the validation
    loss, the learning rate and the speed of those steps; printed where show."""
    since = run.rows[-1]["step"] if run.rows else 0
    losses = [loss for step, loss in run.history if step > since]
    s, T = run.settings, run.model.config.context
    steps = run.step_seconds[-(run.step - since) :] if run.step > since and run.step_seconds else []
    row = {
        "step": run.step,
        "train_loss": float(np.mean(losses)) if losses else None,
        "val_loss": val_loss,
        "lr": warmup_cosine_lr(run.step - 1, lr=s["lr"], warmup=s["warmup"], total=s["steps"], min_lr=s["min_lr"])
        if run.step else None,  # the last step's
        "tokens_per_s": len(steps) * s["batch"] * T / sum(steps) if steps else None,
        "seconds": sum(run.step_seconds),
    }  # fmt: skip
    run.rows.append(row)
    if show:
        end_bar(run)
        train = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        speed = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
        lr = "-" if row["lr"] is None else f"{row['lr']:.2e}"
        print(f"{run.step:>7}  {train:>10}  {val_loss:>8.4f}  {lr:>9}  {speed:>9}  "
              f"{row['seconds']:>7.1f}s", flush=True)  # fmt: skip


def progress_bar(run: Run, loss: float) -> None:
    """One line on stderr, rewritten in place: the steps done, the loss, tokens per second, time left."""
    recent = run.step_seconds[-20:]
    per_step = sum(recent) / len(recent)
    total, width = run.settings["steps"], 24
    filled = width * run.step // total
    left = (total - run.step) * per_step
    speed = run.settings["batch"] * run.model.config.context / per_step
    line = (f"step {run.step}/{total} [{'#' * filled}{'.' * (width - filled)}] loss {loss:.4f}  "
            f"{speed:,.0f} tokens/s  {clock(left)} left")  # fmt: skip
    print(f"\r{line}", end="", file=sys.stderr, flush=True)
    run.bar = True


def end_bar(run: Run) -> None:
    """End the progress bar's line, so that what is printed next starts on a line of its own."""
    if run.bar:
        outputs.progress("")
        run.bar = False


def clock(seconds: float) -> str:
    """3725.0 -> '1 h 02 min', 65.0 -> '1 min 05 s', 5.0 -> '5 s'."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def say_how_long(run: Run) -> None:
    """After two steps, where the run will take more than a minute: how long, from the second step's time."""
    left = (run.settings["steps"] - run.step) * run.step_seconds[-1]
    if left > 60:
        steps = run.settings["steps"] - run.step
        end_bar(run)
        outputs.progress(f"about {run.step_seconds[-1]:.2f} s a step: the {steps:,} steps left take about "
                        f"{clock(left)} (Ctrl-C stops and keeps a checkpoint)")  # fmt: skip


def save(run: Run, comm: Any = None) -> None:
    """The run's state as a checkpoint in --out (rank 0 writes it; nothing without --out)."""
    if not run.args.out or (comm is not None and comm.Get_rank() != 0) or run.saved_step == run.step:
        return
    arrays = {f"param.{name}": p for name, p in run.model.params.items()}
    arrays |= {f"adamw.{name}": a for name, a in run.optimizer.state_dict().items()}
    arrays["history"] = np.array(run.history, dtype=np.float64).reshape(-1, 2)  # (steps, 2): step, loss
    meta = {
        "step": run.step, "preset": run.preset, "config": run.model.config.to_dict(), "settings": run.settings,
        "tokenizer": run.tokenizer.describe(), "seed": run.args.seed, "rows": run.rows,
        "data": {"source": run.source, "fingerprint": run.fingerprint, "validation": run.validation},
        "rng": text_data.rng_state(run.rng), "dropout_rng": text_data.rng_state(run.dropout_rng),
    }  # fmt: skip
    checkpoint.save(run.args.out, arrays, meta)
    run.saved_step = run.step


def exit_code(stop: BaseException | None) -> int:
    if isinstance(stop, KeyboardInterrupt):
        return interrupts.INTERRUPTED
    return 1 if stop is not None else 0


def sample(run: Run, tokens: int) -> tuple[str, str]:
    """tokens new tokens after sample.py's default prompt, temperature 0.8, seed --seed: (the text, the prompt)."""
    prompt, what = text_data.default_prompt(run.tokenizer)
    return run.tokenizer.decode(generate(run.model, prompt, tokens, temperature=0.8, rng=run.args.seed)), what


# ---------------------------------------------------------------------------------------------------
# --data-parallel


def communicator(args: argparse.Namespace) -> Any:
    """MPI.COMM_WORLD with --data-parallel, else None; exits with the install line where mpi4py is missing."""
    if not args.data_parallel:
        return None
    try:
        return load_mpi().COMM_WORLD
    except ImportError as err:
        sys.exit(f"train.py --data-parallel {err}")


def one_process_seconds(run: Run, repeats: int = 3) -> float:
    """The median time of a step on the whole batch in this process alone (a copy of the model and AdamW,
    so that the run itself does not change): what the processes' step is compared with."""
    alone = copy.deepcopy(run)
    alone.settings = {**run.settings}
    x, y = text_data.random_batch(np.random.default_rng(0), run.train, run.settings["batch"], run.model.config.context)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        train_step(alone, x, y)
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def scaling(run: Run, comm: Any) -> str | None:
    """Rank 0's line on the split's speed (every rank must call it; the others wait while rank 0 times one
    process on the whole batch): the step's time, the Allreduce's part, the speed-up and the efficiency."""
    if not run.step_seconds:
        return None
    if comm.Get_rank() != 0:
        idle_wait(comm)
        return None
    alone = one_process_seconds(run)
    idle_wait(comm)
    size, step = comm.Get_size(), float(np.median(run.step_seconds))
    allreduce = float(np.median(run.allreduce_seconds))
    return (f"a step: {step * 1e3:,.1f} ms on {size} processes ({allreduce * 1e3:,.1f} ms of it in the Allreduce), "
            f"{alone * 1e3:,.1f} ms on one process with the whole batch: speed-up {alone / step:.2f}x, scaling "
            f"efficiency {alone / (size * step):.0%} (medians)")  # fmt: skip
